"""`write_gallery`: a self-contained HTML page from metrics.jsonl and the saved sample grids."""

from __future__ import annotations

import base64
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tracking.html_check import needs_chromium, parse, png_pixels, render_in_chromium
from unirl.tracking.gallery import write_gallery
from unirl.tracking.metrics import JsonlWriter, save_image_grid

XSS = "<script>alert(1)</script>"


REWARD_ROWS = [
    {"step": 1, "reward/mean": 0.10, "reward/std": 0.05, "loss": 0.3},
    {"step": 2, "reward/mean": 0.20, "reward/std": 0.04, "loss": 0.2},
    {"step": 3, "reward/mean": 0.25, "reward/std": float("nan"), "loss": 0.2},
    {
        "step": 4,
        "reward/mean": 0.40,
        "reward/std": 0.06,
        "eval/accuracy_strict": 0.5,
        "eval/accuracy/color": 0.7,
    },
    {"step": 5, "reward/mean": 0.55, "reward/std": 0.05, "loss": float("inf")},
]


def make_run(
    root: Path,
    *,
    with_eval: bool = True,
    with_samples: bool = True,
    name: str = "run-a",
) -> tuple[Path, dict[int, Path]]:
    """A fake run dir: metrics.jsonl (+ step-0 eval row) and two 32x32-tile grids at steps 2 and 5."""
    run = root / name
    w = JsonlWriter(str(run / "metrics.jsonl"))
    if with_eval:
        w.write(
            {"step": 0, "eval/accuracy_strict": 0.25, "eval/accuracy/color": 0.5, "eval/accuracy/count": 0.0}
        )
    for row in REWARD_ROWS:
        row = dict(row)
        if not with_eval:
            row = {k: v for k, v in row.items() if not k.startswith("eval/")}
        w.write(row)
    w.close()
    grids: dict[int, Path] = {}
    if with_samples:
        g = torch.Generator().manual_seed(0)
        for step, b in ((2, 4), (5, 10)):
            imgs = torch.randint(0, 256, (b, 3, 32, 32), generator=g, dtype=torch.uint8)
            prompts = [f"a red circle #{i}" for i in range(b)]
            prompts[1] = XSS
            rewards = [i / 7 for i in range(b)]
            path = run / "samples" / f"step_{step:04d}.png"
            save_image_grid(imgs, str(path), prompts, rewards)
            grids[step] = path
    return run, grids


def test_gallery_is_self_contained_and_matches_files(tmp_path: Path) -> None:
    run, grids = make_run(tmp_path)
    out = write_gallery(str(run))
    assert out == str(run / "gallery.html") and os.path.isfile(out)
    src, doc = parse(out)

    for ref in ("http://", "https://", 'src="/', 'src="samples', "file:"):
        assert ref not in src
    assert doc.script_tags == 0

    # one <img> per grid, newest first, each embedding exactly the file's pixels
    assert len(doc.imgs) == len(grids)
    assert [int(a["data-step"] or -1) for a in doc.imgs] == [5, 2]
    for a in doc.imgs:
        uri = a["src"] or ""
        prefix = "data:image/png;base64,"
        assert uri.startswith(prefix)
        embedded = png_pixels(base64.b64decode(uri[len(prefix) :]))
        on_disk = png_pixels(grids[int(a["data-step"] or -1)].read_bytes())
        assert embedded.shape == on_disk.shape and np.array_equal(embedded, on_disk)
    assert "image-rendering: pixelated" in src

    # prompts are escaped: the literal tag never appears, its escaped form does (once per grid)
    assert XSS not in src
    assert src.count("&lt;script&gt;alert(1)&lt;/script&gt;") == 2
    text = "".join(doc.text)
    assert XSS in text  # ...and it reads back as the original prompt

    # rewards to 3 decimals in the grid's row-major order (grid 5 has 10 tiles -> 8 cols, 2 rows)
    section = src[src.index('id="step-5"') : src.index('id="step-2"')]
    cells = [
        f'<td class="num">{i}</td><td class="num">{i // 8},{i % 8}</td><td class="num">{i / 7:.3f}</td>'
        for i in range(10)
    ]
    positions = [section.index(c) for c in cells]
    assert positions == sorted(positions)

    # reward chart: one point per row with reward/mean; eval chart: one polyline per eval/accuracy* key
    assert "reward-chart" in doc.ids and "eval-chart" in doc.ids
    by_key = {a["data-key"]: (a["points"] or "").split() for a in doc.polylines}
    assert len(by_key["reward/mean"]) == sum("reward/mean" in r for r in REWARD_ROWS)
    assert set(by_key) == {
        "reward/mean",
        "eval/accuracy_strict",
        "eval/accuracy/color",
        "eval/accuracy/count",
    }
    assert len(by_key["eval/accuracy_strict"]) == 2 and len(by_key["eval/accuracy/count"]) == 1
    assert 'class="band"' in src  # ±std band

    # header: name, step count, first-5 vs last-5, last eval accuracy
    assert "<h1>run-a</h1>" in src
    assert "training steps logged5" in text  # header cell text runs together without tags
    mean5 = sum(r["reward/mean"] for r in REWARD_ROWS) / 5  # 5 rows: first 5 == last 5
    assert f"{mean5:.3f} → {mean5:.3f}" in text
    assert "last eval/accuracy_strict" in text and "0.500 (step 4)" in text


def test_gallery_rewrite_is_idempotent_and_title(tmp_path: Path) -> None:
    run, _ = make_run(tmp_path)
    first = Path(write_gallery(str(run))).read_text(encoding="utf-8")
    second = Path(write_gallery(str(run))).read_text(encoding="utf-8")
    assert first == second
    assert sorted(p.name for p in run.iterdir()) == ["gallery.html", "metrics.jsonl", "samples"]
    src, _ = parse(write_gallery(str(run), title="<b>my</b> run"))
    assert "<h1>&lt;b&gt;my&lt;/b&gt; run</h1>" in src


def test_gallery_without_eval_keys_omits_eval_chart(tmp_path: Path) -> None:
    run, _ = make_run(tmp_path, with_eval=False)
    src, doc = parse(write_gallery(str(run)))
    assert "eval-chart" not in doc.ids and "eval-chart-missing" in doc.ids
    assert "eval chart omitted" in src
    assert [a["data-key"] for a in doc.polylines] == ["reward/mean"]


def test_gallery_without_samples_dir(tmp_path: Path) -> None:
    run, _ = make_run(tmp_path, with_samples=False)
    src, doc = parse(write_gallery(str(run)))
    assert doc.imgs == [] and "samples-missing" in doc.ids
    assert "No samples directory" in src
    assert "reward-chart" in doc.ids


def test_gallery_png_without_json(tmp_path: Path) -> None:
    run, grids = make_run(tmp_path)
    os.remove(grids[2].with_suffix(".json"))
    src, doc = parse(write_gallery(str(run)))
    assert len(doc.imgs) == 2
    section = src[src.index('id="step-2"') :]
    assert 'class="prompts"' not in section and "No captions file" in section
    assert 'class="prompts"' in src[src.index('id="step-5"') : src.index('id="step-2"')]


@pytest.mark.parametrize("content", [None, "", "\n{not json\n"])
def test_gallery_empty_or_missing_metrics(tmp_path: Path, content: str | None) -> None:
    run = tmp_path / "empty"
    run.mkdir()
    if content is not None:
        (run / "metrics.jsonl").write_text(content)
    src, doc = parse(write_gallery(str(run)))
    assert {"reward-chart-missing", "eval-chart-missing", "samples-missing", "metrics-note"} <= doc.ids
    assert doc.polylines == [] and doc.imgs == []
    assert "<h1>empty</h1>" in src


def test_eval_only_step_zero_row_is_skipped_for_reward(tmp_path: Path) -> None:
    run = tmp_path / "r"
    run.mkdir()
    rows = [
        {"step": 0, "eval/accuracy": 0.1},
        {"step": 1, "reward/mean": None},
        {"step": 2, "reward/mean": 1.5},
    ]
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    _, doc = parse(write_gallery(str(run)))
    by_key = {a["data-key"]: (a["points"] or "").split() for a in doc.polylines}
    assert len(by_key["reward/mean"]) == 1 and len(by_key["eval/accuracy"]) == 1


@needs_chromium
def test_gallery_renders_in_headless_chromium(tmp_path: Path) -> None:
    run, _ = make_run(tmp_path)
    write_gallery(str(run))
    shot = tmp_path / "shot.png"
    res = render_in_chromium(run, shot)
    assert res.returncode == 0, res.stdout + res.stderr
    pixels = png_pixels(shot.read_bytes())
    assert pixels.shape == (2000, 1200, 3) and len(np.unique(pixels.reshape(-1, 3), axis=0)) > 256
    # the script's own check fails on a page that renders blank
    (run / "gallery.html").write_text("<html><body></body></html>")
    res = render_in_chromium(run, shot)
    assert res.returncode == 1, res.stdout + res.stderr


def test_gallery_shows_text_samples_escaped_newest_first(tmp_path: Path) -> None:
    """A text run saves `samples/step_*.json` without a grid: each step becomes a table of prompt,
    response (HTML-escaped, whitespace kept), reward and token count; image steps are unaffected."""
    samples = tmp_path / "samples"
    samples.mkdir()
    for step, response in ((1, "a <b>bold</b> try"), (2, "7 & 8\nsecond line")):
        rows = [{"prompt": f"p{step}", "response": response, "reward": 0.25 * step, "response_tokens": 3}]
        (samples / f"step_{step:04d}.json").write_text(json.dumps(rows))
    page = Path(write_gallery(str(tmp_path))).read_text()
    assert page.index('id="step-2"') < page.index('id="step-1"')
    assert "a &lt;b&gt;bold&lt;/b&gt; try" in page and "<b>bold</b>" not in page
    assert "7 &amp; 8\nsecond line" in page
    assert 'class="sample text"' in page and "saved sample steps</th><td>2<" in page


def test_gallery_breaks_eval_accuracy_down_by_group(tmp_path: Path) -> None:
    """Text evaluations log `eval/accuracy/greedy/op=add`-style keys: the overall keys get one chart
    and each breakdown (here by op) its own, with one line per value."""
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for step, acc in ((0, 0.2), (10, 0.5)):
            row = {"step": step, "eval/accuracy/greedy": acc, "eval/accuracy/pass@16": acc + 0.3}
            row.update({"eval/accuracy/greedy/op=add": acc + 0.1, "eval/accuracy/greedy/op=mul": acc - 0.1})
            f.write(json.dumps(row) + "\n")
    page = Path(write_gallery(str(tmp_path))).read_text()
    overall = page[page.index('id="eval-chart"') : page.index('id="eval-chart-op"')]
    by_op = page[page.index('id="eval-chart-op"') :]
    assert "eval/accuracy/pass@16" in overall and "op=add" not in overall
    assert (
        "Eval accuracy by op" in by_op and "op=add (last 0.600)" in by_op and "op=mul (last 0.400)" in by_op
    )


def test_videos_are_saved_as_frame_strips_one_per_row(tmp_path: Path) -> None:
    """[B, F, 3, H, W] videos: one row per video, its frames left to right; the gallery labels
    the strips (row, 0)."""
    videos = torch.randint(
        0, 256, (3, 4, 3, 6, 5), generator=torch.Generator().manual_seed(0), dtype=torch.uint8
    )
    path = tmp_path / "run" / "samples" / "step_0001.png"
    save_image_grid(videos, str(path), ["a", "b", "c"], [0.1, 0.2, 0.3])
    grid = png_pixels(path.read_bytes())
    assert grid.shape == (3 * 6, 4 * 5, 3)
    for i in range(3):
        for k in range(4):
            tile = grid[i * 6 : (i + 1) * 6, k * 5 : (k + 1) * 5]
            assert np.array_equal(tile, videos[i, k].permute(1, 2, 0).numpy())
    assert [e["frames"] for e in json.loads(path.with_suffix(".json").read_text())] == [4, 4, 4]
    src, _ = parse(write_gallery(str(tmp_path / "run")))
    for i in range(3):
        assert f'<td class="num">{i}</td><td class="num">{i},0</td>' in src
