"""`python -m worlds.shapes.train_reward_model --config-name=shapes_reward_model` end to end at a tiny
size: data from the committed base and renders, training, export, agreement, and resuming from the
cached data and train state (the second call and the bad recipes in this process, through the same
`run`); a bad recipe is refused before any work, every problem named by its key."""

from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest
import torch
from hydra import compose, initialize_config_dir
from safetensors.torch import load_file

from tests.conftest import REPO, run_module
from worlds.shapes.reward_model import CLASSES, ShapesRewardModel
from worlds.shapes.train_reward_model import run

RECIPES = os.path.join(REPO, "worlds", "shapes", "recipes")

pytestmark = pytest.mark.e2e

TINY = [
    "synth=200", "chunk=8", "base_train=8", "base_heldout=8",
    "eval_prompts=4", "eval_seeds=1", "batch=16", "save_every=10", "threads=2",
]  # fmt: skip


def recipe(*overrides: str):
    with initialize_config_dir(config_dir=RECIPES, version_base=None):
        return compose("shapes_reward_model", overrides=list(overrides))


def test_train_export_and_resume(tmp_path, capsys):
    out, work = tmp_path / "model", tmp_path / "work"
    args = [f"out={out}", f"work={work}", f"base={os.path.join(REPO, 'checkpoints', 'shapes_sd3')}", *TINY]
    first = run_module(
        "worlds.shapes.train_reward_model",
        "--config-name=shapes_reward_model",
        *args,
        "steps=20",
        timeout=600,
    )
    assert first.returncode == 0, first.stderr[-3000:]
    cached = sorted(os.listdir(work))
    assert cached == [
        "base_c8_000.npz",
        "heldout_eval_p4_s1.npz",
        "heldout_train_c8_000.npz",
        "synth_000_n200.npz",
        "train_state.pt",
    ]
    result = json.loads(first.stdout)
    assert result["heldout_eval"]["n"] == 4 and result["heldout_train"]["n"] == 8
    assert result["train_pool"]["n"] == 200 + 2 * 8  # renders, and base samples with their near misses
    assert 0.0 <= result["heldout_train"]["strict/accuracy"] <= 1.0
    assert 0.0 <= result["heldout_train"]["counts_exact"] <= 1.0
    config = json.loads((out / "config.json").read_text())
    assert (
        [tuple(c) for c in config["classes"]] == list(CLASSES)
        and config["steps"] == 20
        and config["seed"] == 0
    )
    with np.load(out / "heldout.npz") as z:
        assert z["heldout_train_images"].shape == (8, 32, 32, 3) and len(z["heldout_eval_prompts"]) == 4
    state = torch.load(work / "train_state.pt")
    assert state["step"] == 20

    capsys.readouterr()
    assert run(recipe(*args, "steps=30")) == 0  # again, in this process
    assert "resuming reward-model training at step 20" in capsys.readouterr().err
    assert sorted(os.listdir(work)) == cached  # no data made twice
    assert torch.load(work / "train_state.pt")["step"] == 30
    model = ShapesRewardModel(str(out))
    score = model.score_differentiable(torch.rand(2, 3, 32, 32), ["a red circle", "two blue squares"])
    assert score.shape == (2,) and ((score >= 0) & (score <= 1)).all()

    # exact resume through the recipe: a 30-step run stopped by its wall-clock bound after its first
    # step (the state saved between save points, nothing exported) and run again equals the
    # uninterrupted 30-step run (weights, Adam's moments, the schedule, the batches),
    # both on the data cached above
    straight, stopped = tmp_path / "straight", tmp_path / "stopped"
    for name in (straight, stopped):
        (name / "work").mkdir(parents=True)
        for f in cached[:-1]:  # the data chunks, not the train state
            shutil.copy(work / f, name / "work" / f)
    common = [a for a in args if not a.startswith(("out=", "work="))] + ["steps=30"]
    assert run(recipe(*common, f"out={straight / 'model'}", f"work={straight / 'work'}")) == 0
    capsys.readouterr()
    assert (
        run(recipe(*common, f"out={stopped / 'model'}", f"work={stopped / 'work'}", "max_seconds=1e-9")) == 0
    )
    assert "stopped at step 1 of 30" in capsys.readouterr().err and not (stopped / "model").exists()
    assert run(recipe(*common, f"out={stopped / 'model'}", f"work={stopped / 'work'}")) == 0
    a = load_file(str(straight / "model" / "model.safetensors"))
    b = load_file(str(stopped / "model" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_a_bad_recipe_is_refused_before_any_work(tmp_path, capsys):
    """Every problem is named by its key before any data is made (exit 2)."""
    for overrides, messages in (
        (["base_train=10"], ["base_train=10 must be a multiple of chunk=64"]),
        ([f"base={tmp_path / 'no'}"], ["is not a directory"]),
        (["steps=0", "lr=abc"], ["steps must be >= 1, got 0", "lr: expected a valid number, got 'abc'"]),
    ):
        with pytest.raises(SystemExit) as exit_:
            run(recipe(f"out={tmp_path / 'model'}", f"work={tmp_path / 'work'}", *overrides))
        err = capsys.readouterr().err
        assert exit_.value.code == 2 and all(m in err for m in messages), err
    assert not (tmp_path / "work").exists()
