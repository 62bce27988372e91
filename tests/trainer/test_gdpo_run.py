"""`advantage.multi_reward: gdpo` through the driver: a tiny Flow-GRPO run with two weighted
reward components trains, its reward still their weighted sum (GDPO changes the advantages only;
their formula is tested in tests/types/test_advantages.py)."""

from __future__ import annotations

import math

from tests.recipes import IN_PROCESS, run

TWO_REWARDS = [
    "+advantage.multi_reward=gdpo",
    "+reward.backend.components.green={_target_: unirl.reward.local.ColorTarget, target: [0.0, 1.0, 0.0]}",
    "+reward.backend.weights.green=0.5",
]


def test_a_gdpo_run_trains_on_two_rewards(tmp_path) -> None:
    rows = run("diffusion/tiny_sd3_flowgrpo", tmp_path, "num_steps=2", *IN_PROCESS, *TWO_REWARDS)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]) and "reward/green/mean" in r and "reward/redness/mean" in r
        total = r["reward/redness/mean"] + 0.5 * r["reward/green/mean"]
        assert abs(r["reward/mean"] - total) < 1e-5  # the reward is still the weighted sum
