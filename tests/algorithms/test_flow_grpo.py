"""Flow-GRPO loss, pi_old freezing and the on-policy ratio invariant (no Ray)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.algorithms.linear_stage import (
    LinearStage,
    assert_relative,
    flow_grpo_reference_loss,
    grads_of,
    hand_replay,
    loss_and_grads,
    perturb,
    sampled_track,
)
from tests.conftest import tiny_model_config
from unirl.algorithms.advantages import track_advantages
from unirl.algorithms.ddpo import DDPOConfig
from unirl.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig, clipped_policy_loss
from unirl.algorithms.flow_ppo import FlowPPOConfig
from unirl.models.sd3 import SD3Stage
from unirl.rollout.trainside import TrainsideEngine
from unirl.sde.schedules import sigmas_for
from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend
from unirl.train.stack import TrainStack, TrainStackConfig
from unirl.types import AdvantageConfig, DiffusionSamplingParams, PromptExample, RolloutReq


def make_setup(
    algo_cfg: FlowGRPOConfig, micro: int = 4, updates: int = 1, lora: bool = True, guidance: float = 2.0
):
    bundle = tiny_model_config().build()
    stage = SD3Stage(bundle, replay_steps_per_forward=2)
    backend = TrainBackend(
        stage.module,
        LoRAConfig(rank=4, alpha=8) if lora else None,
        OptimConfig(lr=1e-2, weight_decay=0.0),
        10,
        keep_reference=algo_cfg.beta > 0,
    )
    stage.module = backend.module
    stack = TrainStack(
        stage,
        backend,
        FlowGRPO(algo_cfg),
        TrainStackConfig(micro_batch_size=micro, num_updates_per_batch=updates),
    )
    sp = DiffusionSamplingParams(
        num_steps=4,
        samples_per_prompt=4,
        height=16,
        width=16,
        guidance_scale=guidance,
        eta=0.7,
        max_sequence_length=8,
        sde_scheduler="all",
    )
    return stage, backend, stack, sp


def scored_track(stage, sp, rollout_id: int = 0):
    sigmas = sigmas_for(sp, stage.bundle.image_seq_len(sp.height, sp.width))
    req = RolloutReq.from_prompts(
        [PromptExample("a red square", "0"), PromptExample("a blue dot", "1")], sp, sigmas, rollout_id
    )
    track = TrainsideEngine(stage, forward_batch_size=3).generate(req).track("diffusion")
    track.rewards = track.media.float().mean(dim=(1, 2, 3))
    track_advantages(track, AdvantageConfig())
    return track


def test_ratio_is_exactly_one_on_first_update_with_replayed_pi_old():
    stage, _, stack, sp = make_setup(FlowGRPOConfig(clip_range=0.2, old_logp_source="replay"), updates=2)
    metrics = stack.train_track(scored_track(stage, sp), progress=0.0)
    assert metrics["ratio/first_update_mean"] == 1.0
    # The second update sees moved weights against the same frozen pi_old.
    assert metrics["ratio/min"] < 1.0 < metrics["ratio/max"]


def test_rollout_log_probs_match_replay_at_train_geometry():
    stage, _, _, sp = make_setup(FlowGRPOConfig())
    track = scored_track(stage, sp)
    seg = track.segment
    with torch.no_grad():
        replayed = torch.cat(
            [stage.replay(seg, track.conditions, s)[0] for s in stage.replay_chunks(seg.sde_indices, seg)], 1
        )
    torch.testing.assert_close(replayed, seg.log_probs, rtol=0, atol=1e-5)


def test_pi_old_stays_frozen_across_updates():
    stage, _, stack, sp = make_setup(FlowGRPOConfig(clip_range=0.2), updates=3)
    track = scored_track(stage, sp)
    before = track.segment.log_probs.clone()
    metrics = stack.train_track(track, progress=0.0)
    assert torch.equal(track.segment.log_probs, before)
    assert metrics["ratio/first_update_mean"] == pytest.approx(1.0, abs=1e-5)
    assert metrics["train/skipped_step"] == 0


def test_clipped_policy_loss_against_hand_computation():
    new = torch.tensor([[math.log(1.5), math.log(0.5)]])
    old = torch.zeros(1, 2)
    adv = torch.tensor([2.0])
    loss, ratio = clipped_policy_loss(new, old, adv, clip=0.2)
    # r=1.5: max(-2*1.5, -2*1.2) = -2.4 ; r=0.5: max(-2*0.5, -2*0.8) = -1.0
    torch.testing.assert_close(ratio, torch.tensor([[1.5, 0.5]]))
    torch.testing.assert_close(loss, torch.tensor([[-2.4, -1.0]]))
    loss_neg, _ = clipped_policy_loss(new, old, torch.tensor([-1.0]), clip=0.2)
    # A<0: r=1.5: max(1.5, 1.2) = 1.5 ; r=0.5: max(0.5, 0.8) = 0.8
    torch.testing.assert_close(loss_neg, torch.tensor([[1.5, 0.8]]))


# rows 0 and 1 beyond +-5 (clipped), rows 2 and 3 inside (kept)
ADVANTAGES = torch.tensor([7.0, -9.0, 1.5, -2.5])


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [0], [1], [2], [3]])
def test_advantage_clip_matches_flow_grpos_training_loop(rows):
    """Loss and gradient against yifan123/flow_grpo, scripts/train_sd3.py, `main`'s training loop
    (`flow_grpo_reference_loss`: the advantage clamped to +-adv_clip_max in both PPO terms) to 1e-5
    relative, on the batch and on each clipped and kept row alone; without the clip, the loss of a
    batch with a clipped row is another (so the comparison can fail)."""
    stage = LinearStage()
    check_advantage_clip(stage, sampled_track(stage), rows)


def check_advantage_clip(stage: LinearStage, track, rows: list[int]) -> None:
    """Flow-GRPO's default config on `track`'s rows `rows` (advantages ADVANTAGES) against
    `flow_grpo_reference_loss`: loss and gradient to 1e-5 relative, the clipped share, and a
    different loss without the clip when a clipped row is in the batch."""
    track.advantages = ADVANTAGES.clone()
    track = track.select(rows)
    perturb(stage, 0.05)  # ratios 0.97..1.03: clip_range 0.02 clips some steps and keeps others
    out, got = loss_and_grads(FlowGRPO(FlowGRPOConfig(clip_range=0.02)), stage, track)
    logp, old = hand_replay(stage, track)[0], track.segment.log_probs
    want = flow_grpo_reference_loss(logp, old, track.advantages, 0.02, 5.0)
    assert out["loss"] == pytest.approx(float(want.detach()), rel=1e-5)
    assert_relative(got, grads_of(want, stage), 1e-5)
    clipped = track.advantages.abs() > 5
    assert out["adv_clipped_frac"] == float(clipped.float().mean())
    unclipped = float(flow_grpo_reference_loss(logp, old, track.advantages, 0.02, math.inf).detach())
    assert (abs(unclipped - out["loss"]) > 0.1 * abs(out["loss"])) == bool(clipped.any())


def test_adv_clip_max_null_leaves_advantages_as_they_are():
    stage = LinearStage()
    track = sampled_track(stage)
    track.advantages = ADVANTAGES.clone()
    perturb(stage, 0.05)
    out, got = loss_and_grads(FlowGRPO(FlowGRPOConfig(clip_range=0.02, adv_clip_max=None)), stage, track)
    want = flow_grpo_reference_loss(
        hand_replay(stage, track)[0], track.segment.log_probs, ADVANTAGES, 0.02, math.inf
    )
    assert out["loss"] == pytest.approx(float(want.detach()), rel=1e-5)
    assert_relative(got, grads_of(want, stage), 1e-5)
    assert "adv_clipped_frac" not in out


@pytest.mark.parametrize("value", [0.0, -5.0])
def test_adv_clip_max_errors_name_the_key(value):
    with pytest.raises(ValueError, match="algorithm.config.adv_clip_max must be > 0 or null"):
        FlowGRPOConfig(adv_clip_max=value)
    # Flow-GRPO, GRPO-Guard, DanceGRPO, MixGRPO and DDPO clip at 5 as their code does; Flow-PPO's
    # whitened GAE advantages are not clipped (PPO's loss does not clip them)
    assert FlowGRPOConfig().adv_clip_max == DDPOConfig().adv_clip_max == 5.0
    assert FlowPPOConfig().adv_clip_max is None


@pytest.mark.parametrize(
    ("schedule", "progress", "expected"),
    [
        ("constant", 0.7, 0.2),
        ("linear", 0.5, 0.15),
        ("linear", 1.0, 0.1),
        ("cosine", 0.5, 0.15),
        ("cosine", 0.0, 0.2),
    ],
)
def test_clip_schedule(schedule, progress, expected):
    cfg = FlowGRPOConfig(clip_range=0.2, clip_range_final=0.1, clip_schedule=schedule)
    assert cfg.clip_at(progress) == pytest.approx(expected)


def test_kl_to_reference_is_zero_while_lora_is_identity():
    # LoRA B starts at zero, so the policy equals the reference on the first update.
    stage, _, stack, sp = make_setup(FlowGRPOConfig(clip_range=0.2, beta=0.1, old_logp_source="replay"))
    metrics = stack.train_track(scored_track(stage, sp), progress=0.0)
    assert metrics["kl"] == 0.0
    metrics = stack.train_track(scored_track(stage, sp, rollout_id=1), progress=0.1)
    assert metrics["kl"] > 0.0


def test_kl_full_finetune_uses_frozen_copy():
    stage, backend, stack, sp = make_setup(FlowGRPOConfig(clip_range=0.2, beta=0.1), lora=False)
    stack.train_track(scored_track(stage, sp), progress=0.0)
    metrics = stack.train_track(scored_track(stage, sp, rollout_id=1), progress=0.1)
    assert metrics["kl"] > 0.0
    # the live weights are restored after each reference forward
    assert not all(torch.equal(a, b) for a, b in zip(backend.params, backend._reference, strict=True))


def test_non_finite_grad_norm_skips_the_step():
    stage, backend, stack, sp = make_setup(FlowGRPOConfig(clip_range=0.2))
    track = scored_track(stage, sp)
    track.advantages = track.advantages.clone()
    track.advantages[0] = float("nan")
    before = [p.detach().clone() for p in backend.params]
    metrics = stack.train_track(track, progress=0.0)
    assert metrics["train/skipped_step"] == 1
    assert backend.skipped_steps == 1 and backend.optimizer_steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, backend.params, strict=True))


def test_micro_batch_must_divide_rank_batch():
    stage, _, stack, sp = make_setup(FlowGRPOConfig(), micro=3)
    with pytest.raises(ValueError, match="micro_batch_size=3 does not divide"):
        stack.train_track(scored_track(stage, sp), progress=0.0)


def test_eta_zero_track_is_rejected():
    stage, _, stack, sp = make_setup(FlowGRPOConfig())
    sp.eta = 0.0
    with pytest.raises(ValueError, match="no SDE steps"):
        stack.train_track(scored_track(stage, sp), progress=0.0)


def test_same_initial_noise_shares_x_T_within_a_group_only():
    stage, _, _, sp = make_setup(FlowGRPOConfig())
    shared_sp = dataclasses.replace(sp, same_initial_noise=True)
    own, shared = scored_track(stage, sp).segment, scored_track(stage, shared_sp).segment
    k = sp.samples_per_prompt
    x_t, x_t_own = shared.at(0), own.at(0)
    for g in range(2):
        group = x_t[g * k : (g + 1) * k]
        assert all(torch.equal(x, group[0]) for x in group)  # one x_T per group
        assert torch.equal(group[0], x_t_own[g * k])  # the group's first sample keeps its own x_T...
        final = shared.at(sp.num_steps)[g * k : (g + 1) * k]
        assert not any(torch.equal(final[0], x) for x in final[1:])  # ...and siblings their own SDE noise
    assert not torch.equal(x_t[0], x_t[k])  # groups differ
    assert len({tuple(x.flatten()[:4].tolist()) for x in x_t_own}) == len(x_t_own)  # default: all differ
    # the first sample of each group is the same whole trajectory in both modes
    torch.testing.assert_close(shared.latents[::k], own.latents[::k], rtol=0, atol=0)
    torch.testing.assert_close(shared.log_probs[::k], own.log_probs[::k], rtol=0, atol=0)
