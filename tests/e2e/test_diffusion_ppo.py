"""`diffusion/tiny_ppo` (Flow-PPO: a per-step critic) through its entry point
(`unirl.train_diffusion.main` on the composed, shrunk recipe: it validates and trains in this
process, one worker without Ray), 2 steps with the critic warming up alone on the first: the
policy frozen there, exactly on-policy on its first update after, the critic's steps and value
normalization recorded; resumed from the step-1 checkpoint it equals the uninterrupted run
(rows, critic state with its normalization, policy weights). And the diffusion recipes a critic
makes wrong, refused before Ray naming the key."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import untimed
from tests.e2e.test_tiny_lm_ppo import critic_state, flat
from tests.recipes import IN_PROCESS, composed, exported_weights, recipe, rows, run, same_weights
from unirl.config.validate import ConfigError

pytestmark = [pytest.mark.e2e]

NAME = "diffusion/tiny_ppo"
RUN = [
    *IN_PROCESS,
    "num_steps=2",
    "checkpoint.every_n_steps=1",
    "critic.warmup_steps=1",
    "threads_per_worker=1",
]


def test_entry_point_warmup_and_exact_resume(tmp_path):
    from unirl.train_diffusion import main

    full = tmp_path / "full"
    main(composed(NAME, full, *RUN))
    first, second = rows(full)
    # step 1: the critic alone, the policy frozen: no policy loss, the LoRA export still zero-effect
    assert first["critic/warmup"] == 1.0 and "loss" not in first and "critic/vf_loss" in first
    lora = exported_weights(full, "step_000001/weights")
    assert lora and all(not v.any() for k, v in lora.items() if "lora_B" in k)
    # step 2: both; the first update is exactly on-policy (pi_old replayed)
    assert second["critic/warmup"] == 0.0 and second["ratio/min"] == second["ratio/max"] == 1.0
    assert {"critic/vf_explained_var", "critic/norm_std", "critic/returns_mean"} <= set(second)
    extra = torch.load(full / "checkpoints" / "step_000002" / "critic" / "rank0.pt", weights_only=False)
    assert extra["counters"]["optimizer_steps"] == 2 * 4  # steps x critic epochs (one mini-batch)
    assert extra["algorithm"]["value_norm"]["w"] > 0

    part = tmp_path / "part"
    resumed = run(NAME, part, *RUN, f"resume_from={full}/checkpoints/step_000001")
    assert [untimed(r) for r in resumed] == [untimed(second)]
    a, b = flat(critic_state(full, 2, tmp_path)), flat(critic_state(part, 2, tmp_path))
    assert a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )
    resumed_extra = torch.load(
        part / "checkpoints" / "step_000002" / "critic" / "rank0.pt", weights_only=False
    )
    assert resumed_extra["algorithm"] == extra["algorithm"]
    assert same_weights(full, part)


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        (
            NAME,
            ["algorithm._target_=unirl.algorithms.flow_grpo.FlowGRPO", "~algorithm.config"],
            "critic: FlowGRPO ignores a critic's values",
        ),
        (NAME, ["critic=null"], "algorithm: FlowPPO trains on a critic's values"),
        (NAME, ["advantage.lam=1.5"], r"advantage.lam must be in \[0, 1\]"),
        (NAME, ["advantage.gamma=0"], r"advantage.gamma must be in \(0, 1\]"),
        (NAME, ["critic.warmup_steps=3", "num_steps=3"], "critic.warmup_steps=3 must be < num_steps=3"),
        (NAME, ["critic.value_norm_beta=1.0"], r"critic.value_norm_beta must be in \(0, 1\)"),
        (
            "llm/tiny_lm_ppo",
            ["~critic.model", "+critic.model={_target_: unirl.models.flow.value.FlowValueConfig}"],
            "critic.model: FlowValueConfig values diffusion tracks, but this is a text recipe",
        ),
        (NAME, ["advantage.estimator=grpo"], "FlowPPO trains on the critic's per-step GAE advantages"),
    ],
)
def test_bad_diffusion_critic_recipes_refused_before_ray(tmp_path, name, overrides, message):
    with pytest.raises(ConfigError, match=message):
        recipe(name, tmp_path, *overrides)
