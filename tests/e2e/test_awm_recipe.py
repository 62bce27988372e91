"""The tiny AWM recipe trained 2 steps through the trainer in this process (inband data plane,
shrunk: 2 prompts x 8 samples at 16x16, 4 denoising steps), and its recipe errors before Ray: AWM with
neither constraint, its EMA KL without an EMA, a timestep range outside [0, 1] or holding none
of the schedule's sigmas."""

from __future__ import annotations

import math

import pytest

from tests.recipes import IN_PROCESS, recipe, run
from unirl.config.validate import ConfigError

pytestmark = [pytest.mark.e2e]

SHRINK = [
    *IN_PROCESS,
    "num_steps=2",
    "prompts_per_rollout=2",
    "sampling.num_steps=4",
    "sampling.height=16",
    "sampling.width=16",
    "sampling.max_sequence_length=8",
    "model.tiny.resolution=16",
    "model.tiny.clip_max_length=8",
    "algorithm.config.draws_per_sample=1",
    "threads_per_worker=1",
]


def test_tiny_awm_trains(tmp_path):
    rows = run("diffusion/tiny_awm", tmp_path, *SHRINK)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert {"awm/weighted_error", "awm/sigma_mean", "ema_kl", "policy_loss"} <= set(r)
        assert math.isfinite(r["loss"]) and r["train/skipped_step"] == 0
        assert r["ratio/first_update_mean"] == 1.0  # w_old is the sampling weights' own
    assert rows[0]["ema_kl"] == 0.0 < rows[1]["ema_kl"]  # the EMA starts as the weights, then trails them


@pytest.mark.parametrize(
    "overrides, needle",
    [
        (["algorithm.config.clip_range=null", "algorithm.config.ema_kl_beta=0"], "allow_unconstrained"),
        (["train.ema=null"], "train.ema is null"),
        (["algorithm.config.timestep_range=[0.2,1.5]"], "algorithm.config.timestep_range"),
        (["algorithm.config.timestep_range=[0.995,0.999]"], "algorithm.config.timestep_range"),
        (["algorithm.config.timestep_distribution=beta"], "algorithm.config.timestep_distribution"),
    ],
)
def test_bad_awm_recipes_are_refused_before_ray(tmp_path, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        recipe("diffusion/tiny_awm", tmp_path, *SHRINK, *overrides, expect="diffusion")
