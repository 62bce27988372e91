#!/usr/bin/env bash
# Render a self-contained HTML page (a run's gallery.html, or a `python -m unirl.view` report) with
# headless Chromium to a PNG screenshot and check it is non-trivial.
#
# Usage: scripts/check_gallery_chromium.sh <run_dir | page.html> [out.png]
#   <run_dir> renders <run_dir>/gallery.html; out.png defaults to <page stem>_screenshot.png beside the page
#   (<run_dir>/gallery_screenshot.png).
#   PYTHON (default: the repository's .venv/bin/python if present, else python3) must have Pillow installed.
# Exit status: 0 ok, 1 check failed, 2 usage / missing dependency.
set -euo pipefail

if [[ $# -lt 1 || $# -gt 2 ]]; then
    echo "usage: $0 <run_dir | page.html> [out.png]" >&2
    exit 2
fi
if [[ -f "$1" ]]; then
    html=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
else
    html=$(cd "$1" && pwd)/gallery.html
fi
out=${2:-"${html%.html}_screenshot.png"}
out=$(cd "$(dirname "$out")" && pwd)/$(basename "$out")

if [[ -z "${PYTHON:-}" ]]; then
    venv_python="$(cd "$(dirname "$0")/.." && pwd)/.venv/bin/python"
    if [[ -x "$venv_python" ]]; then PYTHON=$venv_python; else PYTHON=python3; fi
fi

chromium_bin=""
for c in chromium chromium-browser; do
    if command -v "$c" >/dev/null 2>&1; then chromium_bin=$(command -v "$c"); break; fi
done
if [[ -z "$chromium_bin" ]]; then
    echo "error: chromium is not installed; on Debian run: apt-get install -y chromium" >&2
    exit 2
fi
if [[ ! -f "$html" ]]; then
    echo "error: $html not found; write it first with unirl.tracking.gallery.write_gallery('$1')" >&2
    exit 2
fi

profile=$(mktemp -d)
trap 'rm -rf "$profile"' EXIT
rm -f "$out"

echo "rendering $html -> $out"
# no network is needed: the page embeds everything; the flags keep Chromium from phoning home
timeout 120 "$chromium_bin" --headless --no-sandbox --disable-gpu --disable-quic --no-first-run \
    --disable-background-networking --disable-component-update --disable-sync \
    --user-data-dir="$profile" --hide-scrollbars \
    --screenshot="$out" --window-size=1200,2000 "file://$html" >"$profile/chromium.log" 2>&1 || {
    echo "error: chromium failed (exit $?); its log:" >&2
    tail -n 20 "$profile/chromium.log" >&2
    exit 1
}

if [[ ! -s "$out" ]]; then
    echo "error: chromium wrote no screenshot at $out" >&2
    tail -n 20 "$profile/chromium.log" >&2
    exit 1
fi
size=$(stat -c %s "$out")
if ((size <= 10240)); then
    echo "error: screenshot is only $size bytes (expected > 10 kB): page probably blank" >&2
    exit 1
fi

"$PYTHON" - "$out" <<'EOF'
import sys

from PIL import Image

path = sys.argv[1]
with Image.open(path) as im:
    rgb = im.convert("RGB")
    size = rgb.size
    # getcolors returns None when there are more than maxcolors distinct colours
    colors = rgb.getcolors(maxcolors=256)
n = "more than 256" if colors is None else str(len(colors))
if colors is not None and len(colors) < 2:
    sys.exit(f"error: screenshot {path} is a single colour")
print(f"screenshot ok: {path} {size[0]}x{size[1]}, {n} distinct colours")
EOF
echo "ok: $out ($size bytes)"
