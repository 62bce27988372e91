"""The reward-backprop recipes (DRaFT, AlignProp, ReFL on the shapes base with the learned reward)
train a few steps in this process: in-process launcher, inband data plane, small batches.
(`python -m unirl.train_diffusion` runs in tests/e2e/test_tiny_recipe.py.)"""

from __future__ import annotations

import math

import pytest

from tests.conftest import KERNEL_ROUNDING
from tests.recipes import run

pytestmark = pytest.mark.e2e

SMALL = [
    "launcher=in_process",
    "transport=inband",
    "num_steps=2",
    "prompts_per_rollout=2",
    "sampling.samples_per_prompt=2",
    "sampling.num_steps=4",
    "train.stack.micro_batch_size=2",
    "threads_per_worker=2",
    "eval.every_n_steps=2",
    "eval.sampling.samples_per_prompt=1",
    "eval.sampling.num_steps=2",
    "logging.progress=false",
    "logging.save_images_every=2",
]
NO_EVAL = ["eval.every_n_steps=0"]  # the held-out evaluation is the same for all three: run it once
RECIPES = {
    "shapes_draft": ["algorithm.config.steps=2"],
    "shapes_alignprop": ["algorithm.config.max_steps=3", *NO_EVAL],
    "shapes_refl": NO_EVAL,
}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_recipe_trains(name, tmp_path):
    rows = run(f"diffusion/{name}", tmp_path, *SMALL, *RECIPES[name])
    if name == "shapes_draft":
        assert [r["step"] for r in rows] == [0, 1, 2]
        assert "eval/accuracy_strict" in rows[0] and "eval/accuracy_strict" in rows[2]
        rows = rows[1:]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["loss"]) and row["train/grad_norm"] > 0
        assert 0.0 <= row["backprop/reward_mean"] <= 1.0
        assert {"reward/learned/mean", "reward/strict/mean"} <= set(row)
    first = rows[0]
    if name != "shapes_refl":  # the loss re-runs the rollout's own samples on its first update
        # the rollout's own noise: 0 up to rounding, accumulated over the sampling steps
        assert first["backprop/x0_drift"] <= 10 * KERNEL_ROUNDING
        # the learned reward of the same images: float in the loss, uint8 in the driver's scoring
        assert first["backprop/reward_mean"] == pytest.approx(first["reward/learned/mean"], abs=0.02)
    assert (tmp_path / "checkpoints" / "final").is_dir()
