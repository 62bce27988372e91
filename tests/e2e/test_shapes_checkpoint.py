"""The committed pretrained shapes model: the recipes that load it validate and run, and its held-out
accuracy leaves RL room (issue 4 asks for a base of roughly 10%-60%)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from tests.conftest import REPO
from tests.recipes import IN_PROCESS, run
from unirl.config.validate import validate_recipe
from unirl.evaluate import main as evaluate_main
from unirl.models.sd3 import SD3Bundle

pytestmark = pytest.mark.e2e


def test_shapes_recipe_validates_with_the_committed_model():
    with initialize_config_dir(config_dir=str(Path(REPO) / "examples"), version_base=None):
        cfg = compose("diffusion/shapes_flowgrpo")
    validate_recipe(cfg)
    assert (Path(REPO) / cfg.model.pretrained_path / "model_index.json").is_file()


def test_committed_base_leaves_rl_room(capsys):
    """`python -m unirl.evaluate` with a recipe override: one seed per held-out prompt (51 images,
    a quarter of the recipe's 4) takes a quarter of the time; its strict accuracy was 0.315
    (0.389 over the recipe's 4 seeds), inside the 10-60% band with room on both sides."""
    capsys.readouterr()
    overrides = ["eval.sampling.samples_per_prompt=1"]
    assert evaluate_main(["--recipe", "diffusion/shapes_flowgrpo", *overrides]) == 0
    m = json.loads(capsys.readouterr().out)
    assert 0.10 <= m["eval/accuracy_strict"] <= 0.60, m
    cats = [m[f"eval/accuracy/{c}"] for c in ("two_objects", "counting", "position")]
    assert m["eval/accuracy_strict"] == pytest.approx(sum(cats) / 3)


def test_stage_two_continues_from_the_committed_export(tmp_path):
    """`diffusion/shapes_sft` from the committed export (its second stage's settings) trains it and
    exports a model that moved a little from it (same architecture, same data)."""
    base = Path(REPO) / "checkpoints" / "shapes_sd3"
    out = tmp_path / "export"
    stage_two = [f"model.pretrained_path={base}", "~model.tiny", "seed=1", "train.optim.lr=5e-4"]
    small = [
        "num_steps=2",
        "prompts_per_rollout=2",
        "train.stack.micro_batch_size=2",
        "train.optim.warmup_steps=1",
    ]
    small += ["eval.every_n_steps=0", "checkpoint.every_n_steps=0", "threads_per_worker=1"]
    run("diffusion/shapes_sft", tmp_path / "run", *IN_PROCESS, *stage_two, *small, f"export_dir={out}")
    source = SD3Bundle.from_pretrained(str(base))
    trained = SD3Bundle.from_pretrained(str(out))
    deltas = [
        float((p.detach() - q.detach()).abs().max())
        for p, q in zip(source.transformer.parameters(), trained.transformer.parameters(), strict=True)
    ]
    assert 0 < max(deltas) < 0.05  # moved by two small steps, from the committed weights


def test_nft_recipe_trains_the_committed_model_on_policy(tmp_path, capsys):
    """`diffusion/shapes_nft` (ODE rollouts, DiffusionNFT) trains the committed model in this
    process: its first update of every rollout is on-policy (v_new == v_old exactly) and the run
    exports weights that the evaluate command loads."""
    rows = run(
        "diffusion/shapes_nft",
        tmp_path,
        *IN_PROCESS,
        "num_steps=2",
        "prompts_per_rollout=2",
        "sampling.samples_per_prompt=4",
        "train.stack.micro_batch_size=4",
        "eval.every_n_steps=2",
        "eval.sampling.samples_per_prompt=1",
        "eval.sampling.num_steps=4",
    )
    assert [r["step"] for r in rows] == [0, 1, 2]
    for row in rows[1:]:
        assert row["nft/v_drift_mse"] == 0.0 and row["nft/optimality_mean"] == pytest.approx(0.5, abs=1e-5)
        assert row["train/grad_norm"] > 0.0
    assert "eval/accuracy_strict" in rows[0] and "eval/accuracy_strict" in rows[2]
    capsys.readouterr()
    checkpoint = str(tmp_path / "checkpoints" / "final")
    argv = ["--recipe", "diffusion/shapes_nft", "--checkpoint", checkpoint]
    assert evaluate_main([*argv, "eval.sampling.samples_per_prompt=1", "eval.sampling.num_steps=4"]) == 0
    scores = json.loads(capsys.readouterr().out)
    # the exported LoRA file, loaded onto the base, matches the run's adapted weights to float
    # rounding; an image's pixels may then round differently and flip one prompt's verdict
    assert scores["eval/accuracy_strict"] == pytest.approx(rows[2]["eval/accuracy_strict"], abs=0.04)
    assert scores["eval/dense"] == pytest.approx(rows[2]["eval/dense"], abs=0.01)
