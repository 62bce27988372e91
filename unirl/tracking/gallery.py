"""A self-contained HTML gallery of one run: reward/eval curves and every saved sample grid.

`write_gallery(run_dir)` reads `<run_dir>/metrics.jsonl` (written by `JsonlWriter`) and every
`<run_dir>/samples/step_*.png` with its `.json` caption file (written by `save_image_grid`), or, for a
text run, `samples/step_*.json` alone (a list of `{prompt, response, reward, response_tokens}`), and
writes `<run_dir>/gallery.html`. The page needs no server and no network: images are embedded as base64
`data:` URIs, the CSS is inline, the curves are inline SVG generated here, and there is no JavaScript.
(Inline SVG in HTML needs no `xmlns`, so the page contains no URL at all.)

Sample sections are ordered newest step first, so the latest samples are at the top of the page.
Every prompt is HTML-escaped. The file is replaced atomically on each call, so the trainer can call
this after every image save and at the end of the run.
"""

from __future__ import annotations

import base64
import glob
import html
import json
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from PIL import Image

from unirl.tracking.metrics import read_rows

__all__ = ["write_gallery"]

GALLERY_NAME = "gallery.html"
REWARD_KEY = "reward/mean"
REWARD_STD_KEY = "reward/std"
EVAL_PREFIX = "eval/accuracy"
# tab10: distinguishable, colour-blind friendlier than a rainbow
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#7f7f7f",
    "#bcbd22",
    "#17becf",
)
STEP_RE = re.compile(r"step_(\d+)\.(?:png|json)$")

# chart geometry (SVG user units; the SVG scales to the page width)
_W, _H = 720, 260
_ML, _MR, _MT, _MB = 64, 16, 14, 40

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px; color: #222;
       background: #fafafa; }
h1 { margin: 0 0 8px 0; font-size: 1.6em; }
h2 { margin-top: 28px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.summary { border-collapse: collapse; margin: 8px 0 16px 0; }
.summary th { text-align: left; padding: 2px 16px 2px 0; font-weight: 600; color: #555; }
.summary td { padding: 2px 0; font-variant-numeric: tabular-nums; }
.note { color: #8a6d3b; background: #fcf8e3; border: 1px solid #faebcc; padding: 6px 10px;
        border-radius: 4px; display: inline-block; margin: 4px 0; }
figure { margin: 12px 0 20px 0; background: #fff; border: 1px solid #e3e3e3; border-radius: 6px;
         padding: 10px; max-width: 760px; }
figcaption { font-weight: 600; margin-bottom: 6px; }
svg.chart { width: 100%; height: auto; display: block; }
svg.chart text { font-size: 11px; fill: #444; }
ul.legend { list-style: none; padding: 0; margin: 6px 0 0 0; display: flex; flex-wrap: wrap; gap: 4px 18px;
            font-size: 0.85em; }
ul.legend li { display: flex; align-items: center; gap: 6px; }
.swatch { display: inline-block; width: 18px; height: 4px; border-radius: 2px; }
.swatch.band { height: 10px; opacity: 0.35; }
section.sample { background: #fff; border: 1px solid #e3e3e3; border-radius: 6px; padding: 10px 14px;
                 margin: 14px 0; }
section.sample h3 { margin: 2px 0 10px 0; }
.sample-body { display: flex; flex-wrap: wrap; gap: 18px; align-items: flex-start; }
img.grid { image-rendering: pixelated; image-rendering: crisp-edges; border: 1px solid #ccc;
           max-width: 100%; height: auto; background: #000; }
table.prompts { border-collapse: collapse; font-size: 0.85em; }
table.prompts th, table.prompts td { border-bottom: 1px solid #eee; padding: 2px 10px 2px 0;
                                     text-align: left; vertical-align: top; }
table.prompts td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.prompts td.prompt { max-width: 520px; overflow-wrap: anywhere; }
table.prompts td.response { max-width: 520px; overflow-wrap: anywhere; white-space: pre-wrap; font-family: monospace; }
"""


@dataclass
class Series:
    """One polyline: a name, its (step, value) points sorted by step, a colour and a stroke width."""

    name: str
    points: list[tuple[float, float]]
    color: str
    width: float = 1.5


def finite(v: Any) -> float | None:
    """`v` as a float if it is a finite real number (bools excluded), else None."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    f = float(v)
    return f if math.isfinite(f) else None


def fmt(v: float) -> str:
    """Compact number for tick labels and the summary."""
    if v == int(v) and abs(v) < 1e9:
        return str(int(v))
    return f"{v:.4g}"


def fmt3(v: Any) -> str:
    """Reward with 3 decimals, or an em dash when missing / non-finite."""
    f = finite(v)
    return "—" if f is None else f"{f:.3f}"


def _read_metrics(path: str) -> tuple[list[dict[str, Any]], str | None]:
    """Rows of `metrics.jsonl` (malformed lines skipped, `read_rows`) and a note when the file is
    absent or empty, or names the lines skipped."""
    if not os.path.isfile(path):
        return [], "No metrics.jsonl in this run directory."
    rows, problems = read_rows(path)  # a bad line: e.g. a half-written last one while the trainer appends
    if not rows:
        return [], "metrics.jsonl is empty." if not problems else "metrics.jsonl has no readable rows."
    return rows, (f"{len(problems)} unreadable line(s) skipped: " + "; ".join(problems) if problems else None)


def series_of(rows: list[dict[str, Any]], key: str) -> list[tuple[float, float]]:
    """(step, value) for every row with a numeric `step` and a finite `key`, sorted by step."""
    pts = []
    for row in rows:
        x, y = finite(row.get("step")), finite(row.get(key))
        if x is not None and y is not None:
            pts.append((x, y))
    pts.sort(key=lambda p: p[0])
    return pts


def _eval_keys(rows: list[dict[str, Any]]) -> list[str]:
    """All `eval/accuracy*` keys with at least one finite value: strict, overall, then the rest sorted."""
    keys = {k for row in rows for k, v in row.items() if k.startswith(EVAL_PREFIX) and finite(v) is not None}
    first = [k for k in (f"{EVAL_PREFIX}_strict", EVAL_PREFIX) if k in keys]
    return first + sorted(keys - set(first))


def svg_chart(
    label: str,
    series: list[Series],
    band: list[tuple[float, float, float]] | None = None,
    y_range: tuple[float, float] | None = None,
    y_label: str = "",
) -> str:
    """An inline SVG line chart: one polyline per series, an optional (step, lo, hi) band, axes with
    min/max tick labels. The y axis spans `y_range` if given, else the data (and band) min/max."""
    xs = [p[0] for s in series for p in s.points] + [b[0] for b in band or []]
    ys = [p[1] for s in series for p in s.points] + [v for b in band or [] for v in b[1:]]
    x0, x1 = min(xs), max(xs)
    y0, y1 = y_range if y_range is not None else (min(ys), max(ys))
    if x1 == x0:
        x0, x1 = x0 - 1, x1 + 1
    if y1 == y0:
        pad = abs(y0) * 0.05 or 0.5
        y0, y1 = y0 - pad, y1 + pad
    pw, ph = _W - _ML - _MR, _H - _MT - _MB

    def sx(x: float) -> float:
        return _ML + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return _MT + (1 - (y - y0) / (y1 - y0)) * ph

    out = [
        f'<svg class="chart" viewBox="0 0 {_W} {_H}" width="{_W}" height="{_H}" role="img" '
        f'aria-label="{html.escape(label)}">',
        f"<title>{html.escape(label)}</title>",
        f'<rect x="{_ML}" y="{_MT}" width="{pw}" height="{ph}" fill="#fff" stroke="#999"/>',
    ]
    # ticks + labels: min/max on both axes, and dashed grid lines at the y extremes
    bottom, left = _MT + ph, _ML
    for yv, anchor_y in ((y0, sy(y0)), (y1, sy(y1))):
        out.append(
            f'<line x1="{left - 5}" y1="{anchor_y:.1f}" x2="{left}" y2="{anchor_y:.1f}" stroke="#666"/>'
        )
        out.append(
            f'<text x="{left - 8}" y="{anchor_y + 4:.1f}" text-anchor="end" class="tick">{fmt(yv)}</text>'
        )
    for xv in (x0, x1):
        px = sx(xv)
        out.append(f'<line x1="{px:.1f}" y1="{bottom}" x2="{px:.1f}" y2="{bottom + 5}" stroke="#666"/>')
        out.append(f'<text x="{px:.1f}" y="{bottom + 18}" text-anchor="middle" class="tick">{fmt(xv)}</text>')
    out.append(f'<text x="{_ML + pw / 2:.1f}" y="{_H - 4}" text-anchor="middle">step</text>')
    if y_label:
        cy = _MT + ph / 2
        out.append(
            f'<text x="14" y="{cy:.1f}" text-anchor="middle" transform="rotate(-90 14 {cy:.1f})">'
            f"{html.escape(y_label)}</text>"
        )
    if band and series:
        upper = " ".join(f"{sx(x):.1f},{sy(hi):.1f}" for x, _, hi in band)
        lower = " ".join(f"{sx(x):.1f},{sy(lo):.1f}" for x, lo, _ in reversed(band))
        out.append(
            f'<polygon class="band" points="{upper} {lower}" fill="{series[0].color}" '
            'fill-opacity="0.18" stroke="none"/>'
        )
    for s in series:
        pts = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in s.points)
        out.append(
            f'<polyline data-key="{html.escape(s.name)}" points="{pts}" fill="none" stroke="{s.color}" '
            f'stroke-width="{s.width}" stroke-linejoin="round"><title>{html.escape(s.name)}</title></polyline>'
        )
        if len(s.points) <= 60:  # markers keep single points and sparse eval series visible
            for x, y in s.points:
                out.append(f'<circle cx="{sx(x):.1f}" cy="{sy(y):.1f}" r="2.2" fill="{s.color}"/>')
    out.append("</svg>")
    return "\n".join(out)


def legend_html(items: list[tuple[str, str, str]]) -> str:
    """An HTML legend: (text, colour, swatch css class) per entry."""
    lis = "".join(
        f'<li><span class="{cls}" style="background:{color}"></span>{html.escape(text)}</li>'
        for text, color, cls in items
    )
    return f'<ul class="legend">{lis}</ul>'


def _reward_chart(rows: list[dict[str, Any]]) -> str:
    """The reward/mean figure (with a ±reward/std band when logged), or a note when there is no reward."""
    pts = series_of(rows, REWARD_KEY)
    if not pts:
        return f'<p class="note" id="reward-chart-missing">No <code>{REWARD_KEY}</code> values in metrics.jsonl; reward chart omitted.</p>'
    band = []
    for row in rows:
        x, m, s = finite(row.get("step")), finite(row.get(REWARD_KEY)), finite(row.get(REWARD_STD_KEY))
        if x is not None and m is not None and s is not None:
            band.append((x, m - s, m + s))
    band.sort(key=lambda b: b[0])
    color = PALETTE[0]
    items = [(f"{REWARD_KEY} (last {fmt3(pts[-1][1])})", color, "swatch")]
    if band:
        items.append((f"± {REWARD_STD_KEY}", color, "swatch band"))
    svg = svg_chart(
        "reward/mean vs step", [Series(REWARD_KEY, pts, color, 2.0)], band or None, y_label="reward"
    )
    return f'<figure id="reward-chart"><figcaption>Reward</figcaption>{svg}{legend_html(items)}</figure>'


def _eval_chart(rows: list[dict[str, Any]]) -> str:
    """One figure with a polyline per overall `eval/accuracy*` key, then one figure per breakdown
    (keys ending in `/<name>=<value>`, e.g. accuracy per operation), or a note when no eval was logged."""
    keys = _eval_keys(rows)
    if not keys:
        return f'<p class="note" id="eval-chart-missing">No <code>{EVAL_PREFIX}*</code> keys in metrics.jsonl; eval chart omitted.</p>'
    overall = [k for k in keys if "=" not in k.rsplit("/", 1)[-1]]
    by: dict[str, list[str]] = {}
    for k in keys:
        if k not in overall:
            by.setdefault(k.rsplit("/", 1)[-1].split("=", 1)[0], []).append(k)
    figures = [_eval_figure(rows, overall, "eval-chart", "Eval accuracy")] if overall else []
    figures += [
        _eval_figure(rows, ks, f"eval-chart-{name}", f"Eval accuracy by {name}")
        for name, ks in sorted(by.items())
    ]
    figures = [f for f in figures if f]
    if not figures:
        return (
            '<p class="note" id="eval-chart-missing">Eval keys have no numeric step; eval chart omitted.</p>'
        )
    return "\n".join(figures)


def _eval_figure(rows: list[dict[str, Any]], keys: list[str], fid: str, caption: str) -> str:
    series = []
    for i, k in enumerate(keys):
        width = 2.5 if k == f"{EVAL_PREFIX}_strict" else 1.5
        series.append(Series(k, series_of(rows, k), PALETTE[i % len(PALETTE)], width))
    series = [s for s in series if s.points]  # keys logged without a numeric step
    if not series:
        return ""
    ys = [y for s in series for _, y in s.points]
    y_range = (0.0, 1.0) if min(ys) >= 0 and max(ys) <= 1 else None
    svg = svg_chart(caption.lower() + " vs step", series, y_range=y_range, y_label="accuracy")
    key_list = legend_html([(f"{s.name} (last {fmt3(s.points[-1][1])})", s.color, "swatch") for s in series])
    return f'<figure id="{html.escape(fid)}"><figcaption>{html.escape(caption)}</figcaption>{svg}{key_list}</figure>'


def _summary(name: str, rows: list[dict[str, Any]], n_grids: int) -> str:
    """Header table: steps, first-5 vs last-5 mean reward, last eval accuracy, number of sample grids."""
    rewards = [y for _, y in series_of(rows, REWARD_KEY)]
    steps = [s for s in (finite(r.get("step")) for r in rows) if s is not None]
    items: list[tuple[str, str]] = [
        ("training steps logged", str(len(rewards))),
        ("last step", fmt(max(steps)) if steps else "—"),
    ]
    if rewards:
        first, last = rewards[:5], rewards[-5:]
        items.append(
            (
                "mean reward (first 5 → last 5)",
                f"{sum(first) / len(first):.3f} → {sum(last) / len(last):.3f}",
            )
        )
    keys = _eval_keys(rows)
    if keys:
        pts = series_of(rows, keys[0])
        if pts:
            step, acc = pts[-1]
            items.append((f"last {keys[0]}", f"{acc:.3f} (step {fmt(step)})"))
    items.append(("saved sample steps", str(n_grids)))
    body = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in items)
    return f'<h1>{html.escape(name)}</h1>\n<table class="summary" id="summary">{body}</table>'


def _grid_ncols(n: int, width: int, height: int) -> int:
    """Columns of a grid of `n` tiles in a `width` x `height` image: `save_image_grid`'s default
    min(n, 8) when it fits, else the column count that gives the squarest tiles."""
    default = max(1, min(n, 8))

    def fits(c: int) -> bool:
        return width % c == 0 and height % math.ceil(n / c) == 0

    if n <= 0 or fits(default):
        return default
    cands = [c for c in range(1, n + 1) if fits(c)]
    if not cands:
        return default
    return min(cands, key=lambda c: abs(math.log((width / c) / (height / math.ceil(n / c)))))


def _read_json_list(path: str) -> list | None:
    """The JSON list saved in `path`; None when the file cannot be read or holds something else."""
    try:
        with open(path, encoding="utf-8") as f:
            entries = json.load(f)
    except (OSError, ValueError):
        return None
    return entries if isinstance(entries, list) else None


def _section_head(path: str, css: str, label: str, id_prefix: str) -> tuple[int | None, str]:
    """The step of a sample file and its section's opening tags: id `<id_prefix>step-<n>`, heading
    `<label> · Step <n>` (label and prefix empty in a one-run gallery)."""
    base = os.path.basename(path)
    m = STEP_RE.search(base)
    step = int(m.group(1)) if m else None
    title = f"Step {step}" if step is not None else html.escape(base)
    title = f"{html.escape(label)} · {title}" if label else title
    sid = f"step-{step}" if step is not None else "sample-" + re.sub(r"[^A-Za-z0-9_-]", "_", base)
    return step, f'<section class="{css}" id="{html.escape(id_prefix)}{sid}"><h3>{title}</h3>'


def sample_section(path: str, label: str = "", id_prefix: str = "") -> str:
    """One saved step, a grid (`.png`) or a text run's samples (`.json`): `image_section` or
    `text_section`."""
    section = text_section if path.endswith(".json") else image_section
    return section(path, label, id_prefix)


def image_section(png: str, label: str = "", id_prefix: str = "") -> str:
    """One saved step: the embedded grid image and its prompts/rewards in row-major order."""
    base = os.path.basename(png)
    step, head = _section_head(png, "sample", label, id_prefix)
    parts = [head + '<div class="sample-body">']
    notes = []
    size = None
    try:
        with open(png, "rb") as f:
            data = f.read()
        with Image.open(png) as im:
            size = im.size
    except (OSError, ValueError) as e:
        notes.append(f"Image could not be read ({type(e).__name__}).")
    if size is not None:
        w, h = size
        scale = max(1, min(4, 1024 // max(w, 1)))  # tiny 32px tiles: show them 3-4x, pixelated
        b64 = base64.b64encode(data).decode("ascii")
        parts.append(
            f'<img class="grid" data-step="{"" if step is None else step}" alt="sample grid {html.escape(base)}" '
            f'width="{w * scale}" height="{h * scale}" src="data:image/png;base64,{b64}">'
        )

    entries = None
    cap_path = os.path.splitext(png)[0] + ".json"
    if not os.path.isfile(cap_path):
        notes.append("No captions file for this grid.")
    else:
        entries = _read_json_list(cap_path)
        if entries is None:
            notes.append("Captions file could not be read.")
    if entries is not None:
        ncols = _grid_ncols(len(entries), *size) if size is not None else max(1, min(len(entries), 8))
        if any(isinstance(e, dict) and "frames" in e for e in entries):
            ncols = 1  # videos: one frame strip per row (save_image_grid)
        trs = []
        for i, e in enumerate(entries):
            e = e if isinstance(e, dict) else {"prompt": e}
            r, c = divmod(i, ncols)
            prompt = e.get("prompt", "")
            prompt = prompt if isinstance(prompt, str) else json.dumps(prompt)
            trs.append(
                f'<tr><td class="num">{i}</td><td class="num">{r},{c}</td>'
                f'<td class="num">{fmt3(e.get("reward"))}</td><td class="prompt">{html.escape(prompt)}</td></tr>'
            )
        parts.append(
            '<table class="prompts"><thead><tr><th>#</th><th>row,col</th><th>reward</th><th>prompt</th></tr>'
            f"</thead><tbody>{''.join(trs)}</tbody></table>"
        )
    parts.append("</div>")
    parts.extend(f'<p class="note">{html.escape(n)}</p>' for n in notes)
    parts.append("</section>")
    return "\n".join(parts)


def text_section(path: str, label: str = "", id_prefix: str = "") -> str:
    """One saved step of a text run: prompt, response and reward of every sample."""
    _, head = _section_head(path, "sample text", label, id_prefix)
    parts = [head]
    entries = _read_json_list(path)
    if entries is None:
        parts.append('<p class="note">Samples file could not be read.</p></section>')
        return "\n".join(parts)
    trs = []
    for i, e in enumerate(entries):
        e = e if isinstance(e, dict) else {"response": e}
        prompt, response = (str(e.get(k, "")) for k in ("prompt", "response"))
        trs.append(
            f'<tr><td class="num">{i}</td><td class="num">{fmt3(e.get("reward"))}</td>'
            f'<td class="num">{html.escape(str(e.get("response_tokens", "")))}</td>'
            f'<td class="prompt">{html.escape(prompt)}</td><td class="response">{html.escape(response)}</td></tr>'
        )
    parts.append(
        '<table class="prompts"><thead><tr><th>#</th><th>reward</th><th>tokens</th><th>prompt</th>'
        f"<th>response</th></tr></thead><tbody>{''.join(trs)}</tbody></table></section>"
    )
    return "\n".join(parts)


def sample_files(run_dir: str) -> list[str]:
    """`samples/step_*.png`, and the `step_*.json` of text runs (no grid beside them), newest step
    first (names without a step number last, by name)."""
    pngs = glob.glob(os.path.join(glob.escape(run_dir), "samples", "step_*.png"))
    pngs += [
        j
        for j in glob.glob(os.path.join(glob.escape(run_dir), "samples", "step_*.json"))
        if not os.path.isfile(os.path.splitext(j)[0] + ".png")
    ]

    def key(p: str) -> tuple[int, int, str]:
        m = STEP_RE.search(os.path.basename(p))
        return (0, -int(m.group(1)), p) if m else (1, 0, p)

    return sorted(pngs, key=key)


def write_gallery(run_dir: str, title: str | None = None) -> str:
    """Write `<run_dir>/gallery.html` from `metrics.jsonl` and `samples/step_*.png` (+ `.json`).

    The page is self-contained (base64 images, inline CSS and SVG, no URLs, no scripts) and lists the
    sample grids newest step first. Missing metrics, keys or samples give a note instead of a chart or
    section. The file is replaced atomically, so calling this repeatedly is safe.

    Args:
        run_dir: the run directory holding `metrics.jsonl` and `samples/`.
        title: page heading; defaults to the basename of `run_dir`.

    Returns:
        The path of the written `gallery.html`.
    """
    name = title or os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
    rows, metrics_note = _read_metrics(os.path.join(run_dir, "metrics.jsonl"))
    pngs = sample_files(run_dir)

    body = [_summary(name, rows, len(pngs))]
    if metrics_note:
        body.append(f'<p class="note" id="metrics-note">{html.escape(metrics_note)}</p>')
    body.append("<h2>Curves</h2>")
    body.append(_reward_chart(rows))
    body.append(_eval_chart(rows))
    body.append("<h2>Samples <small>(newest step first)</small></h2>")
    if not os.path.isdir(os.path.join(run_dir, "samples")):
        body.append('<p class="note" id="samples-missing">No samples directory in this run.</p>')
    elif not pngs:
        body.append('<p class="note" id="samples-missing">No sample grids saved yet.</p>')
    body.extend(sample_section(p) for p in pngs)

    return write_page(os.path.join(run_dir, GALLERY_NAME), f"{name} · gallery", body)


def write_page(out: str, title: str, body: list[str], css: str = "") -> str:
    """Write a self-contained HTML page to `out` (replaced atomically: a reader never sees half a
    page): `title`, the gallery's CSS plus `css`, and the `body` fragments. Returns `out`."""
    doc = (
        "<!DOCTYPE html>\n"
        '<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(title)}</title>\n<style>{CSS}{css}</style>\n</head>\n<body>\n"
        + "\n".join(body)
        + "\n</body>\n</html>\n"
    )
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    tmp = out + f".tmp{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(doc)
    os.replace(tmp, out)
    return out
