"""`python -m unirl.view` on two real tiny runs (and the trackers those runs fed): the report's
curves, timing, config diff and samples; a corrupted metrics line; the page in headless Chromium."""

from __future__ import annotations

import contextlib
import io
import re
import shutil
import sys
from pathlib import Path

import pytest

from tests.recipes import IN_PROCESS, composed, rows, run
from tests.tracking.html_check import needs_chromium, parse, png_pixels, render_in_chromium
from unirl.entry import run as run_entry
from unirl.tracking.report import ABSENT, config_diff
from unirl.view import main as view

RECIPE = "diffusion/tiny_sd3_flowgrpo"
# the shrunk tiny recipe (tests/recipes.py) in this process, 2 steps, samples at both
SMALL = [*IN_PROCESS, "num_steps=2", "logging.save_images_every=1", "threads_per_worker=1"]


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory) -> tuple[Path, Path, str]:
    """Run A (lr 3e-3, TensorBoard and console) and run B (lr 1e-3, an optional W&B tracker that
    cannot start: the wandb package is made unimportable); B's stderr."""
    root = tmp_path_factory.mktemp("runs")
    a, b = root / "lr3e-3", root / "lr1e-3"
    run(RECIPE, a, *SMALL, "++tracking=[tensorboard,console]")
    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.setitem(sys.modules, "wandb", None)
        run(RECIPE, b, *SMALL, "train.optim.lr=1e-3", "++tracking=[{name:wandb,optional:true}]")
    return a, b, err.getvalue()


def test_the_trainer_feeds_its_trackers(two_runs) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    a, b, b_err = two_runs
    events = EventAccumulator(str(a / "tensorboard"), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    logged = rows(a)
    for key in ("reward/mean", "loss", "time/step_s"):
        assert [(e.step, e.value) for e in events.Scalars(key)] == [
            (r["step"], pytest.approx(r[key], rel=1e-6)) for r in logged
        ]
    assert [i.step for i in events.Images("samples")] == [1, 2]
    config = events.Tensors("config/text_summary")[0].tensor_proto.string_val[0].decode()
    assert '"lr": 0.003' in config and '"tracking": [' in config
    # B went on without the tracker that could not start, and said so
    assert "warning: tracking[0]: tracker 'wandb' failed to start: ModuleNotFoundError" in b_err
    assert len(rows(b)) == 2 and not (b / "wandb").exists()


def test_a_required_tracker_that_cannot_start_stops_the_run(tmp_path, monkeypatch, capsys) -> None:
    """Through the entry point's runner: exit 1 naming the tracker, no row written."""
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(SystemExit) as stop:
        run_entry(composed(RECIPE, tmp_path, *SMALL, "++tracking=[wandb]"), "single", "diffusion")
    assert stop.value.code == 1
    assert (
        "error: tracking[0]: tracker 'wandb' failed to start: ModuleNotFoundError" in capsys.readouterr().err
    )
    assert not (tmp_path / "metrics.jsonl").exists()


def diff_table(src: str) -> dict[str, list[str]]:
    """The config diff table of a report: key -> the cells of each run."""
    table = src[src.index('id="config-diff"') : src.index("</table>", src.index('id="config-diff"'))]
    return {
        key: re.findall(r"<td>(.*?)</td>", cells)
        for key, cells in re.findall(r"<tr><th>([^<]*)</th>((?:<td>.*?</td>)+)</tr>", table)
    }


def test_view_compares_two_runs(two_runs, tmp_path, capsys) -> None:
    a, b, _ = two_runs
    out = tmp_path / "report.html"
    assert view([str(a), str(b), "--out", str(out)]) == 0
    assert capsys.readouterr().err == ""
    src, doc = parse(str(out))
    assert doc.script_tags == 0 and "http" not in src and "warnings" not in doc.ids
    assert {"runs", "reward-chart", "component-chart-0", "timing", "config-diff"} <= doc.ids
    # one line per run in each chart, one point per step
    lines = [(p["data-key"], len((p["points"] or "").split())) for p in doc.polylines]
    assert lines == [("lr3e-3", 2), ("lr1e-3", 2)] * 2  # reward/mean, reward/redness/mean
    assert "reward/redness/mean" in src
    for phase in ("time/rollout_s", "time/reward_s", "time/train_s", "time/step_s"):
        assert f"<th>{phase}</th>" in src
    assert src.count('<div class="bar"') == 2
    # the config diff: exactly the keys the two runs set differently
    assert diff_table(src) == {
        "output_dir": [str(a), str(b)],
        "tracking": [
            "[&quot;tensorboard&quot;, &quot;console&quot;]",
            "[{&quot;name&quot;: &quot;wandb&quot;, &quot;optional&quot;: true}]",
        ],
        "train.optim.lr": ["0.003", "0.001"],
    }
    # samples per step, newest first, each run's grid side by side
    assert src.index('id="samples-step-2"') < src.index('id="samples-step-1"')
    assert {"run0-step-2", "run1-step-2", "run0-step-1", "run1-step-1"} <= doc.ids
    assert len(doc.imgs) == 4


def test_view_names_a_corrupted_metrics_line_and_renders_the_rest(two_runs, tmp_path, capsys) -> None:
    a, b, _ = two_runs
    broken = tmp_path / "broken"
    shutil.copytree(a, broken, ignore=shutil.ignore_patterns("base_model", "checkpoints", "tensorboard"))
    lines = (broken / "metrics.jsonl").read_text().splitlines(keepends=True)
    (broken / "metrics.jsonl").write_text('{"step": 1, "reward/me\n' + lines[1])
    out = tmp_path / "report.html"
    assert view([str(broken), str(b), "--out", str(out)]) == 0
    bad = f"{broken}/metrics.jsonl:1: not valid JSON"
    assert bad in capsys.readouterr().err
    src, doc = parse(str(out))
    assert "warnings" in doc.ids and bad in src
    reward = [(p["data-key"], len((p["points"] or "").split())) for p in doc.polylines][:2]
    assert reward == [("broken", 1), ("lr1e-3", 2)]  # the broken run keeps its readable step


def test_view_refuses_a_missing_run_dir(tmp_path, capsys) -> None:
    assert view([str(tmp_path / "nope")]) == 2
    assert f"not a run directory: {tmp_path / 'nope'}" in capsys.readouterr().err


def test_config_diff() -> None:
    one = {"a": 1, "b": {"c": [1, 2], "d": "x"}, "same": {"k": 0}}
    two = {"a": 1, "b": {"c": [1, 3], "d": "x", "e": None}, "same": {"k": 0}}
    three = {"a": 2, "b": {"c": [1, 2], "d": "x"}, "same": {"k": 0}}
    assert config_diff([one, two, three]) == [
        ("a", [1, 1, 2]),
        ("b.c", [[1, 2], [1, 3], [1, 2]]),
        ("b.e", [ABSENT, None, ABSENT]),
    ]
    assert config_diff([one, dict(one)]) == []


@needs_chromium
def test_view_renders_in_headless_chromium(two_runs, tmp_path) -> None:
    a, b, _ = two_runs
    out = tmp_path / "report.html"
    assert view([str(a), str(b), "--out", str(out)]) == 0
    shot = tmp_path / "shot.png"
    res = render_in_chromium(out, shot)
    assert res.returncode == 0, res.stdout + res.stderr
    assert png_pixels(shot.read_bytes()).shape == (2000, 1200, 3)
