"""A static HTML report comparing runs: `python -m unirl.view RUN_DIR [RUN_DIR ...]` (`unirl.view`).

`write_report(run_dirs, out)` reads each run's `metrics.jsonl`, `config.yaml` and `samples/` (what
the trainer writes) and writes one self-contained page, drawn with the gallery's pieces
(`unirl.tracking.gallery`: the same SVG charts, sample sections and CSS; no script, no URL):

- a summary table: one row per run, its colour in every chart;
- curves, one line per run: `reward/mean`, each overall `eval/accuracy*` key, and each reward
  component (`reward/<name>/mean`);
- the timing breakdown: mean seconds per step of each `time/...` phase, and the share of the step
  each of rollout, reward, engine release and train takes, as a bar per run;
- the config diff: every key of the resolved recipes whose value is not the same in all runs;
- samples per step, newest first: each run's grid or texts at that step side by side.

A line of a `metrics.jsonl` that is not a JSON object is skipped and named (file and line) in
the returned warnings and at the top of the page; a missing file leaves its part out with a
warning. The page never depends on every run having every key.
"""

from __future__ import annotations

import html
import json
import os
import re
from dataclasses import dataclass, field
from typing import Any

import yaml

from unirl.tracking.gallery import (
    EVAL_PREFIX,
    PALETTE,
    REWARD_KEY,
    STEP_RE,
    Series,
    finite,
    fmt3,
    legend_html,
    sample_files,
    sample_section,
    series_of,
    svg_chart,
    write_page,
)
from unirl.tracking.metrics import read_rows

__all__ = ["config_diff", "write_report"]

# the phases of a step, in the order they run (StepRecord); their sum is time/step_s
PHASES = ("time/rollout_s", "time/reward_s", "time/engine_release_s", "time/train_s")
_COMPONENT = re.compile(r"^reward/(.+)/mean$")
ABSENT = "(absent)"
DIFF_OPEN_ROWS = 40  # a longer config diff starts folded

_REPORT_CSS = """
table.runs, table.timing, table.diff { border-collapse: collapse; margin: 8px 0 16px 0; font-size: 0.9em; }
table.runs th, table.runs td, table.timing th, table.timing td, table.diff th, table.diff td {
    border-bottom: 1px solid #e3e3e3; padding: 3px 12px 3px 0; text-align: left; vertical-align: top; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
table.diff td { font-family: monospace; max-width: 420px; overflow-wrap: anywhere; }
.bar { display: flex; width: 480px; height: 14px; border: 1px solid #ccc; background: #fff; }
.bar span { display: block; height: 100%; }
.runs-row { display: flex; flex-wrap: wrap; gap: 14px; align-items: flex-start; }
.runs-row > section.sample { margin: 4px 0; }
"""


@dataclass
class _Run:
    """What the report reads of one run directory."""

    path: str
    label: str
    color: str
    rows: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] | None = None
    samples: dict[int, str] = field(default_factory=dict)  # step -> saved file


def _flatten(node: Any, prefix: str = "") -> dict[str, Any]:
    """A nested mapping as {dotted key: leaf}; lists are leaves."""
    if not isinstance(node, dict):
        return {prefix: node}
    out: dict[str, Any] = {}
    for key, value in node.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def config_diff(configs: list[dict[str, Any]]) -> list[tuple[str, list[Any]]]:
    """(dotted key, value per config) for every key whose value is not the same in all `configs`
    (nested mappings; a key one config lacks has the value `ABSENT` there), sorted by key."""
    flat = [_flatten(c) for c in configs]
    keys = sorted({k for f in flat for k in f})
    rows = [(k, [f.get(k, ABSENT) for f in flat]) for k in keys]
    return [(k, values) for k, values in rows if any(v != values[0] for v in values[1:])]


def _labels(paths: list[str]) -> list[str]:
    """Each run's directory name, or its path as given where two runs share a name."""
    names = [os.path.basename(os.path.normpath(os.path.abspath(p))) for p in paths]
    return [n if names.count(n) == 1 else os.path.normpath(p) for n, p in zip(names, paths, strict=True)]


def _load(path: str, label: str, color: str, warnings: list[str]) -> _Run:
    run = _Run(path, label, color)
    metrics = os.path.join(path, "metrics.jsonl")
    if os.path.isfile(metrics):
        run.rows, problems = read_rows(metrics)
        warnings.extend(problems)
    else:
        warnings.append(f"{metrics}: missing; run {label!r} has no curves")
    config = os.path.join(path, "config.yaml")
    try:
        with open(config, encoding="utf-8") as f:
            loaded = yaml.safe_load(f)
        run.config = loaded if isinstance(loaded, dict) else None
        if run.config is None:
            warnings.append(f"{config}: not a mapping; run {label!r} is left out of the config diff")
    except FileNotFoundError:
        warnings.append(f"{config}: missing; run {label!r} is left out of the config diff")
    except (OSError, yaml.YAMLError) as exc:
        warnings.append(
            f"{config}: unreadable ({type(exc).__name__}); run {label!r} is left out of the config diff"
        )
    for f in sample_files(path):
        m = STEP_RE.search(os.path.basename(f))
        if m:
            run.samples[int(m.group(1))] = f
    return run


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _values(run: _Run, key: str) -> list[float]:
    return [v for v in (finite(r.get(key)) for r in run.rows) if v is not None]


def _runs_table(runs: list[_Run]) -> str:
    head = "<tr><th>run</th><th>path</th><th>steps logged</th><th>mean reward (first 5 → last 5)</th><th>sample steps</th></tr>"
    trs = []
    for run in runs:
        rewards = [y for _, y in series_of(run.rows, REWARD_KEY)]
        trend = f"{_mean(rewards[:5]):.3f} → {_mean(rewards[-5:]):.3f}" if rewards else "—"
        trs.append(
            f'<tr><td><span class="swatch" style="background:{run.color}"></span> {html.escape(run.label)}</td>'
            f'<td>{html.escape(os.path.abspath(run.path))}</td><td class="num">{len(rewards)}</td>'
            f'<td class="num">{trend}</td><td class="num">{len(run.samples)}</td></tr>'
        )
    return f'<table class="runs" id="runs"><thead>{head}</thead><tbody>{"".join(trs)}</tbody></table>'


def _chart(runs: list[_Run], key: str, fid: str, caption: str, y_label: str) -> str:
    """One figure, a line per run that logged `key`, or a note when none did."""
    series = [Series(r.label, series_of(r.rows, key), r.color, 2.0) for r in runs]
    series = [s for s in series if s.points]
    if not series:
        return f'<p class="note" id="{fid}-missing">No run logged <code>{html.escape(key)}</code>.</p>'
    svg = svg_chart(f"{key} vs step", series, y_label=y_label)
    items = [(f"{s.name} (last {fmt3(s.points[-1][1])})", s.color, "swatch") for s in series]
    return f'<figure id="{fid}"><figcaption>{html.escape(caption)}</figcaption>{svg}{legend_html(items)}</figure>'


def _curves(runs: list[_Run]) -> list[str]:
    keys = {k for r in runs for row in r.rows for k in row}
    evals = sorted(k for k in keys if k.startswith(EVAL_PREFIX) and "=" not in k.rsplit("/", 1)[-1])
    components = sorted(m.group(1) for m in map(_COMPONENT.match, keys) if m)
    out = ["<h2>Curves</h2>", _chart(runs, REWARD_KEY, "reward-chart", "Reward", "reward")]
    for i, key in enumerate(evals):
        out.append(_chart(runs, key, f"eval-chart-{i}", key, "accuracy"))
    if components:
        out.append("<h2>Reward components</h2>")
    for i, name in enumerate(components):
        out.append(_chart(runs, f"reward/{name}/mean", f"component-chart-{i}", f"reward/{name}/mean", name))
    return out


def _timing(runs: list[_Run]) -> list[str]:
    keys = sorted({k for r in runs for row in r.rows for k in row if k.startswith("time/")})
    if not keys:
        return [
            "<h2>Timing</h2>",
            '<p class="note" id="timing-missing">No run logged <code>time/...</code>.</p>',
        ]
    keys = [k for k in (*PHASES, "time/step_s") if k in keys] + [
        k for k in keys if k not in PHASES and k != "time/step_s"
    ]
    head = (
        "<tr><th>mean s per step</th>" + "".join(f"<th>{html.escape(r.label)}</th>" for r in runs) + "</tr>"
    )
    trs = []
    for key in keys:
        cells = "".join(
            f'<td class="num">{"—" if (m := _mean(_values(r, key))) is None else f"{m:.4g}"}</td>'
            for r in runs
        )
        trs.append(f"<tr><th>{html.escape(key)}</th>{cells}</tr>")
    out = [
        "<h2>Timing</h2>",
        f'<table class="timing" id="timing"><thead>{head}</thead><tbody>{"".join(trs)}</tbody></table>',
    ]
    phases = [k for k in PHASES if k in keys]
    colors = {k: PALETTE[i] for i, k in enumerate(PHASES)}
    for run in runs:
        means = {k: _mean(_values(run, k)) or 0.0 for k in phases}
        total = sum(means.values())
        if total <= 0:
            continue
        spans = "".join(
            f'<span title="{html.escape(k)} {means[k] / total:.0%}" '
            f'style="width:{100 * means[k] / total:.2f}%;background:{colors[k]}"></span>'
            for k in phases
        )
        out.append(
            f'<p>{html.escape(run.label)}</p><div class="bar" data-run="{html.escape(run.label)}">{spans}</div>'
        )
    out.append(legend_html([(k, colors[k], "swatch") for k in phases]))
    return out


def _config_section(runs: list[_Run]) -> list[str]:
    have = [r for r in runs if r.config is not None]
    out = ["<h2>Config diff</h2>"]
    if len(have) < 2:
        return [
            *out,
            '<p class="note" id="config-missing">Fewer than two runs have a config.yaml to compare.</p>',
        ]
    diff = config_diff([r.config for r in have])
    total = len({k for r in have for k in _flatten(r.config)})
    summary = f"{len(diff)} of {total} keys differ; the rest are the same in every run."
    if not diff:
        return [*out, f"<p>{summary}</p>"]
    head = "<tr><th>key</th>" + "".join(f"<th>{html.escape(r.label)}</th>" for r in have) + "</tr>"
    trs = [
        f"<tr><th>{html.escape(key)}</th>{''.join(f'<td>{html.escape(_show(v))}</td>' for v in values)}</tr>"
        for key, values in diff
    ]
    table = f'<table class="diff" id="config-diff"><thead>{head}</thead><tbody>{"".join(trs)}</tbody></table>'
    # a long diff (runs of different recipes) starts folded, so the samples stay in reach
    opened = " open" if len(diff) <= DIFF_OPEN_ROWS else ""
    out.append(f"<details{opened}><summary>{summary}</summary>{table}</details>")
    return out


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _samples(runs: list[_Run]) -> list[str]:
    steps = sorted({s for r in runs for s in r.samples}, reverse=True)
    out = ["<h2>Samples <small>(newest step first)</small></h2>"]
    if not steps:
        return [*out, '<p class="note" id="samples-missing">No run saved samples.</p>']
    for step in steps:
        out.append(
            f'<section class="step-group" id="samples-step-{step}"><h3>Step {step}</h3><div class="runs-row">'
        )
        for i, run in enumerate(runs):
            if step in run.samples:
                out.append(sample_section(run.samples[step], run.label, f"run{i}-"))
            else:
                out.append(f'<p class="note">{html.escape(run.label)}: no samples at step {step}.</p>')
        out.append("</div></section>")
    return out


def write_report(run_dirs: list[str], out: str, title: str | None = None) -> tuple[str, list[str]]:
    """Write the comparison page of `run_dirs` to `out` (replaced atomically).

    Returns:
        (the path written, the warnings: skipped metrics lines by file and line, missing files).
    """
    warnings: list[str] = []
    labels = _labels(run_dirs)
    runs = [
        _load(p, label, PALETTE[i % len(PALETTE)], warnings)
        for i, (p, label) in enumerate(zip(run_dirs, labels, strict=True))
    ]
    name = title or "UniRL runs: " + ", ".join(labels)
    body = [f"<h1>{html.escape(name)}</h1>", _runs_table(runs)]
    if warnings:
        notes = "".join(f"<li>{html.escape(w)}</li>" for w in warnings)
        body.append(f'<div class="note" id="warnings"><strong>Warnings</strong><ul>{notes}</ul></div>')
    body += _curves(runs) + _timing(runs) + _config_section(runs) + _samples(runs)
    return write_page(os.path.abspath(out), name, body, _REPORT_CSS), warnings
