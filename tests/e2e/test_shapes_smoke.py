"""The shapes smoke recipe trained in this process (`python -m unirl.train_diffusion` and Ray run in
tests/e2e/test_tiny_recipe.py): eval rows, gallery, and the standalone evaluate command, in its
own process once and in this one for the checkpoint and a bad argument."""

from __future__ import annotations

import json

import pytest

from tests.conftest import run_module
from tests.recipes import IN_PROCESS, run
from tests.recipes import rows as read_rows
from unirl.evaluate import main as evaluate_main

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("shapes_smoke")
    run("diffusion/shapes_flowgrpo_smoke", out, *IN_PROCESS, "logging.save_images_every=2")
    return out


def test_eval_rows_at_start_every_n_and_end(run_dir):
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    with_eval = [r["step"] for r in rows if "eval/accuracy_strict" in r]
    assert with_eval == [0, 2, 3]  # step 0, every 2 steps, and the last step
    for key in (
        "eval/accuracy/two_objects",
        "eval/accuracy/counting",
        "eval/accuracy/position",
        "eval/dense",
    ):
        assert 0.0 <= rows[0][key] <= 1.0
    assert "reward/geneval/mean" in rows[1]


def test_gallery_is_written_and_self_contained(run_dir):
    page = (run_dir / "gallery.html").read_text()
    assert page.count("<img") == 2 and "data:image/png;base64," in page
    assert "http://" not in page and "https://" not in page


def test_evaluate_command_matches_the_run_at_step_0(run_dir):
    res = run_module("unirl.evaluate", "--recipe", "diffusion/shapes_flowgrpo_smoke", timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    scores = json.loads(res.stdout)
    first = read_rows(run_dir)[0]
    # same untrained weights, same deterministic sampling: the same numbers
    for key, value in first.items():
        if key.startswith("eval/"):
            assert scores[key] == pytest.approx(value, abs=1e-9), key


def test_evaluate_command_loads_a_checkpoint(run_dir, capsys):
    capsys.readouterr()
    checkpoint = str(run_dir / "checkpoints" / "final")
    assert evaluate_main(["--recipe", "diffusion/shapes_flowgrpo_smoke", "--checkpoint", checkpoint]) == 0
    assert "eval/accuracy_strict" in json.loads(capsys.readouterr().out)
    assert evaluate_main(["--recipe", "diffusion/shapes_flowgrpo_smoke", "--checkpoint", "/nope"]) == 2
    assert "unirl_checkpoint.json" in capsys.readouterr().err
