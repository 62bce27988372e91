"""The tiny DiffusionOPD recipe trained 2 steps through the trainer in this process (inband data
plane, shrunk: 4 prompts x 2 samples at 16x16, 4 denoising steps) with its two committed teachers,
evaluated at 32x32 (decoupled resolution); and its recipe errors before Ray: a training reward,
`v` / `x0` targets under an SDE, a teacher whose LoRA layout differs, an ODE rollout that keeps no
trajectory, a prompt source without a teacher, an evaluation size the model cannot take."""

from __future__ import annotations

import math

import pytest

from tests.recipes import IN_PROCESS, recipe, run
from unirl.config.validate import ConfigError

pytestmark = [pytest.mark.e2e]

SHRINK = [
    *IN_PROCESS,
    "num_steps=2",
    "prompts_per_rollout=4",
    "sampling.num_steps=4",
    "sampling.height=16",
    "sampling.width=16",
    "sampling.max_sequence_length=8",
    "model.tiny.clip_max_length=8",
    "algorithm.config.steps_per_sample=2",
    "train.stack.micro_batch_size=8",
    "eval.every_n_steps=2",
    "eval.sampling.num_steps=2",
    "eval.sampling.samples_per_prompt=1",
    "eval.sampling.height=32",
    "eval.sampling.width=32",
    "threads_per_worker=1",
]


def test_tiny_opd_trains(tmp_path):
    rows = run("diffusion/tiny_opd", tmp_path, *SHRINK)
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows[1:]:
        assert {"opd/target_mse", "opd/velocity_mse", "reward/redness/mean"} <= set(r)
        assert math.isfinite(r["loss"]) and r["loss"] > 0 and r["train/skipped_step"] == 0
        assert r["reward/mean"] == 0.0  # monitors only
    for key in ("eval/redness/redness", "eval/blueness/blueness", "eval/redness/blueness"):
        assert 0 < rows[-1][key] < 1


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["reward.backend.weights.redness=1.0"], r"reward.backend.weights: DiffusionOPD .*\['redness'\]"),
        (["sampling.eta=0.7", "algorithm.config.target=v"], "algorithm.config.target=v .*sampling.eta=0.7"),
        (["train.lora.target_modules=[to_q,to_k,to_v]"], r"teachers.redness=.*only by the teacher \["),
        (["train.lora.rank=4"], "train.lora.rank=4"),
        (["+train.lora.dropout=0.1"], "train.lora.dropout=0.1"),
        (["launcher=ray", "num_devices=2"], "num_devices=2: DiffusionOPD"),
        (["stage.store_trajectory=false"], "stage.store_trajectory"),
        (["~algorithm.config.teachers.blueness"], r"data sources \['blueness'\]"),
        (["eval.sampling.height=30"], "eval.sampling.height=30 must be a multiple of 4"),
        (["eval.sampling.width=64"], "eval.sampling.width=64 exceeds model.tiny.resolution=32"),
    ],
)
def test_bad_opd_recipes_are_refused_before_ray(tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        recipe("diffusion/tiny_opd", tmp_path, *SHRINK, *overrides, expect="diffusion")
