"""The tiny forward-process recipes (AWM, DGPO, CRD) trained 2 steps each through the trainer in
this process (inband data plane, shrunk: 2 prompts x 8 samples at 16x16, 4 denoising steps), and
their recipe errors before Ray: AWM with neither constraint, its EMA KL without an EMA, a timestep
range outside [0, 1] or holding none of the schedule's sigmas; a DGPO or CRD geometry that splits
a prompt group, a loss-side CFG scale without a guided rollout, CRD without its sampling snapshot;
DGPO's group sums on one worker and on two (the shared Ray instance)."""

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


OWN_KEYS = {
    "tiny_awm": {"awm/weighted_error", "awm/sigma_mean", "ema_kl", "policy_loss"},
    "tiny_dgpo": {"dgpo/group_sum_abs", "dgpo/group_weight", "dgpo/error_ref", "kl", "policy_loss"},
    "tiny_dgpo_cfg_free": {"dgpo/group_sum_abs", "clipfrac", "ratio/max", "kl"},
    "tiny_crd": {"crd/implicit_reward_mean", "crd/error_old", "crd/kl_coef", "kl", "policy_loss"},
}
# DGPO's other published mode: CFG-free sampling, the fast EMA reference (beta 2000), the clip
# (acting from a rollout's second update)
VARIANTS = {
    "tiny_dgpo_cfg_free": (
        "tiny_dgpo",
        [
            "sampling.guidance_scale=1.0",
            "algorithm.config.reference=ema",
            "algorithm.config.beta=2000",
            "algorithm.config.clip_range=1e-5",
            "train.stack.num_updates_per_batch=2",
        ],
    )
}


@pytest.mark.parametrize("name", sorted(OWN_KEYS))
def test_tiny_forward_process_recipe_trains(name, tmp_path):
    base, extra = VARIANTS.get(name, (name, []))
    rows = run(f"diffusion/{base}", tmp_path, *SHRINK, *extra)
    assert [r["step"] for r in rows] == [1, 2]
    for r in rows:
        assert OWN_KEYS[name] <= set(r), OWN_KEYS[name] - set(r)
        assert math.isfinite(r["loss"]) and r["train/skipped_step"] == 0
    if name == "tiny_awm":
        assert all(r["ratio/first_update_mean"] == 1.0 for r in rows)  # w_old is the sampling weights' own
        assert rows[0]["ema_kl"] == 0.0 < rows[1]["ema_kl"]  # the EMA starts as the weights, then trails them
    if name == "tiny_dgpo":  # step 1 is at the frozen reference (LoRA starts at zero): every S_G = 0
        assert rows[0]["dgpo/group_sum_abs"] == 0.0 < rows[1]["dgpo/group_sum_abs"]
    if name == "tiny_dgpo_cfg_free":  # the second update of each rollout moved off the sampling weights
        assert all(r["clipfrac"] > 0 and r["ratio/first_update_mean"] == 1.0 for r in rows)
    if name == "tiny_crd":  # step 1 is at the old snapshot (a copy of the start), step 2 is not
        assert rows[0]["crd/implicit_reward_mean"] == 0.0 != rows[1]["crd/implicit_reward_mean"]


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


@pytest.mark.parametrize(
    "name, overrides, needle",
    [
        ("tiny_dgpo", ["train.stack.micro_batch_size=4"], "train.stack.micro_batch_size=4"),
        ("tiny_crd", ["train.stack.micro_batch_size=4"], "train.stack.micro_batch_size=4"),
        ("tiny_dgpo", ["sampling.samples_per_prompt=1"], "sampling.samples_per_prompt=1"),
        (
            "tiny_dgpo",
            ["sampling.guidance_scale=1.0", "algorithm.config.kl_guidance_scale=4.5"],
            "kl_guidance_scale",
        ),
        ("tiny_crd", ["sampling.guidance_scale=1.0"], "algorithm.config.kl_guidance_scale=2.0"),
        ("tiny_crd", ["train.ema=null"], "train.ema is null"),
        ("tiny_crd", ["algorithm.config.centering=median"], "algorithm.config.centering"),
        ("tiny_dgpo", ["algorithm.config.ema_decay=[0,0.0,0.001,1.0]"], "algorithm.config.ema_decay"),
    ],
)
def test_bad_dgpo_and_crd_recipes_are_refused_before_ray(tmp_path, name, overrides, needle):
    with pytest.raises(ConfigError, match=needle):
        recipe(f"diffusion/{name}", tmp_path, *SHRINK, *overrides, expect="diffusion")


@pytest.mark.ray
def test_dgpo_group_sums_are_the_same_on_one_and_two_workers(tmp_path, ray_cluster):
    """tiny_dgpo 2 steps on one worker (in process) and on two (Ray, FSDP2, 8 samples = one
    prompt group per rank): every rank holds whole groups, so the group sums, the loss and the
    gradient norm are the single worker's (to the order of the gradient reduction's sums)."""
    shrink = [s for s in SHRINK if s not in IN_PROCESS] + ["train.stack.micro_batch_size=8"]
    one = run("diffusion/tiny_dgpo", tmp_path / "one", *shrink, *IN_PROCESS)
    two = run("diffusion/tiny_dgpo", tmp_path / "two", *shrink, "num_devices=2", "transport=inband")
    assert one[1]["dgpo/group_sum_abs"] > 0  # step 2 is off the reference: the sums are not trivially 0
    for r1, r2 in zip(one, two, strict=True):
        assert r1["reward/mean"] == pytest.approx(r2["reward/mean"], abs=1e-6)
        for key in ("dgpo/group_sum_mean", "dgpo/group_sum_abs", "loss"):
            assert r1[key] == pytest.approx(r2[key], rel=1e-4, abs=1e-7), key
        assert r1["train/grad_norm"] == pytest.approx(r2["train/grad_norm"], rel=1e-4)
