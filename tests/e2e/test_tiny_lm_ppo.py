"""`llm/tiny_lm_ppo` through its entry point (`unirl.train_vlm.main` on the composed recipe: it
validates and trains, in this process, one worker without Ray), 2 steps with the critic warming up alone on the first: the policy frozen there,
exactly on-policy on its first step after, the critic's steps counted; resumed from the step-1
checkpoint it equals the uninterrupted run (rows, critic state, policy weights). And the recipes
a critic makes wrong, refused before Ray naming the key."""

from __future__ import annotations

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests.conftest import untimed
from tests.recipes import IN_PROCESS, composed, exported_weights, recipe, rows, run, same_weights
from unirl.config.validate import ConfigError

pytestmark = [pytest.mark.e2e]

NAME = "llm/tiny_lm_ppo"
RUN = [*IN_PROCESS, "num_steps=2", "checkpoint.every_n_steps=1", "critic.warmup_steps=1"]  # after LM


def critic_state(out, step: int, tmp) -> dict:
    """The critic's train state (weights, Adam moments) of `out`'s checkpoint at `step`."""
    path = tmp / f"critic_{out.name}_{step}.pt"
    dcp_to_torch_save(str(out / "checkpoints" / f"step_{step:06d}" / "critic" / "train"), str(path))
    return torch.load(path, weights_only=False)


def flat(tree, prefix=""):
    if isinstance(tree, dict):
        return {k: v for key, sub in tree.items() for k, v in flat(sub, f"{prefix}{key}.").items()}
    return {prefix: tree}


def test_entry_point_warmup_and_exact_resume(tmp_path):
    from unirl.train_vlm import main

    full = tmp_path / "full"
    main(composed(NAME, full, *RUN))
    got = rows(full)
    assert [r["step"] for r in got] == [1, 2]
    first, second = got
    # step 1: the critic alone (warm-up), the policy frozen: no policy loss, weights unchanged
    assert first["critic/warmup"] == 1.0 and "loss" not in first and "critic/vf_loss" in first
    policy = exported_weights(full, "step_000001/weights")
    base = {k.split(":", 1)[1]: v for k, v in exported_weights(full, "../base_model").items()}
    assert policy and all(torch.equal(v, base[k.split(":", 1)[1]]) for k, v in policy.items())
    # step 2: both; the first PPO step is exactly on-policy, the later mini-batches and epoch are not
    assert second["critic/warmup"] == 0.0 and second["ratio/first_update_mean"] == 1.0
    assert second["ratio/mean"] != 1.0
    assert {"critic/vf_explained_var", "critic/vf_clipfrac", "critic/returns_mean"} <= set(second)
    counters = torch.load(full / "checkpoints" / "step_000002" / "critic" / "rank0.pt", weights_only=True)
    assert counters["counters"]["optimizer_steps"] == 2 * 2 * 2  # steps x epochs x mini-batches

    part = tmp_path / "part"
    resumed = run(NAME, part, *RUN, f"resume_from={full}/checkpoints/step_000001")
    assert [untimed(r) for r in resumed] == [untimed(second)]
    a, b = flat(critic_state(full, 2, tmp_path)), flat(critic_state(part, 2, tmp_path))
    assert a.keys() == b.keys() and all(
        torch.equal(a[k], b[k]) if isinstance(a[k], torch.Tensor) else a[k] == b[k] for k in a
    )
    assert same_weights(full, part)


@pytest.mark.parametrize(
    ("name", "overrides", "message"),
    [
        (NAME, ["algorithm._target_=unirl.algorithms.grpo.GRPO"], "critic: GRPO ignores a critic's values"),
        (NAME, ["critic=null"], "algorithm: PPO trains on a critic's values"),
        ("llm/tiny_lm_grpo", ["advantage.estimator=gae"], "advantage.estimator=gae computes advantages"),
        (NAME, ["advantage.lam=1.5"], r"advantage.lam must be in \[0, 1\]"),
        (NAME, ["advantage.gamma=1.5"], r"advantage.gamma must be in \(0, 1\]"),
        (NAME, ["critic.warmup_steps=3", "num_steps=3"], "critic.warmup_steps=3 must be < num_steps=3"),
        (
            NAME,
            ["critic.lora={_target_: unirl.train.backend.LoRAConfig, target_modules: [to_q]}"],
            "critic.lora",
        ),
        (NAME, ["train.stack.num_mini_batches=3"], "train.stack.num_mini_batches=3 does not divide"),
    ],
)
def test_bad_critic_recipes_refused_before_ray(tmp_path, name, overrides, message):
    with pytest.raises(ConfigError, match=message):
        recipe(name, tmp_path, *overrides)
