"""GRPO-Guard on Flow-GRPO and DanceGRPO (off: Flow-GRPO's loss; on: the normalised ratio has
mean 0 and one spread at every step, loss and gradient as the formula, the advantage clipped as
flow_grpo's training loop clips it), and the KL on velocities or latents of the step losses and
the reward-backprop regulariser (no Ray; a stand-in linear denoiser,
`tests/algorithms/linear_stage.py`)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.algorithms.linear_stage import (
    LinearStage,
    assert_relative,
    grads_of,
    hand_replay,
    loss_and_grads,
    perturb,
    sampled_track,
)
from unirl.algorithms.dpok import DPOK, DPOKConfig
from unirl.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig, guard_log_ratio
from unirl.algorithms.kl_control import velocity_scale
from unirl.algorithms.reward_backprop import RewardBackpropConfig, sample_generator, velocity_kl
from unirl.sde.strategies import gaussian_log_prob


def run(algo, stage, track, ctx_extra=None):
    prepared = algo.prepare_segment(stage, track)
    perturb(stage, 0.05)
    stage.module.zero_grad()
    ctx = {"loss_scale": 1.0, "progress": 0.0, **(ctx_extra or {})}
    out = algo.compute_loss_and_backward(stage, prepared, ctx)
    return prepared, out, [p.grad.clone() for p in stage.module.parameters()]


def assert_grads(got, stage):
    for g, p in zip(got, stage.module.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("sde", ["flow", "dance"])
def test_guard_off_is_flow_grpos_loss(sde):
    stage = LinearStage(sde=sde)
    track = sampled_track(stage, eta=0.7 if sde == "flow" else 0.4)
    prepared, out, got = run(FlowGRPO(FlowGRPOConfig(clip_range=0.05, guard=False)), stage, track)
    assert prepared is track  # nothing frozen: pi_old is the rollout's
    stage.module.zero_grad()
    logp = hand_replay(stage, track)[0]
    r = torch.exp(logp - track.segment.log_probs)
    a = track.advantages[:, None]
    loss = torch.maximum(-a * r, -a * r.clamp(0.95, 1.05)).mean()
    loss.backward()
    assert out["loss"] == pytest.approx(float(loss.detach()), abs=1e-7)
    assert_grads(got, stage)
    assert "guard/bias" not in out


@pytest.mark.parametrize("sde", ["flow", "dance"])
def test_guard_on_loss_and_gradient_match_the_formula(sde):
    stage = LinearStage(sde=sde)
    track = sampled_track(stage, eta=0.7 if sde == "flow" else 0.4)
    with torch.no_grad():
        old_means = hand_replay(stage, track)[1]
    prepared, out, got = run(FlowGRPO(FlowGRPOConfig(clip_range=0.05, guard=True)), stage, track)
    torch.testing.assert_close(prepared.conditions["guard/old_means"], old_means)
    stage.module.zero_grad()
    logp, mu, std, dt, _ = hand_replay(stage, track)
    bias = ((mu - old_means) ** 2).flatten(2).mean(-1) / (2 * std**2)
    z = (logp - track.segment.log_probs + bias) * std
    r = torch.exp(z)
    a = track.advantages[:, None]
    loss = (torch.maximum(-a * r, -a * r.clamp(0.95, 1.05)) / (-dt)).mean()
    loss.backward()
    assert out["loss"] == pytest.approx(float(loss.detach()), rel=1e-5, abs=1e-7)
    assert out["guard/bias"] == pytest.approx(float(bias.detach().mean()), rel=1e-4)
    assert_grads(got, stage)


@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [0], [1], [2], [3]])
def test_guard_clips_advantages_as_flow_grpos_training_loop(rows):
    """GRPO-Guard with the advantage clip: the formula above with A clamped to +-adv_clip_max (5) in
    both PPO terms, as yifan123/flow_grpo, scripts/train_sd3.py, `main`'s training loop clamps it and
    as X-GenGroup/Flow-Factory, src/flow_factory/trainers/grpo.py, `GRPOGuardTrainer.optimize` does
    before its re-weighted ratio; loss and gradient to 1e-5 relative on the batch and on each clipped
    (|A| > 5) and kept row alone."""
    stage = LinearStage()
    track = sampled_track(stage)
    track.advantages = torch.tensor([7.0, -9.0, 1.5, -2.5])
    algo = FlowGRPO(FlowGRPOConfig(clip_range=0.02, guard=True))
    prepared = algo.prepare_segment(stage, track).select(rows)  # mu_old under the sampling weights
    perturb(stage, 0.05)
    out, got = loss_and_grads(algo, stage, prepared)
    logp, mu, std, dt, _ = hand_replay(stage, prepared)
    bias = ((mu - prepared.conditions["guard/old_means"]) ** 2).flatten(2).mean(-1) / (2 * std**2)
    r = torch.exp((logp - prepared.segment.log_probs + bias) * std)
    a = torch.clamp(prepared.advantages, -5.0, 5.0)[:, None]
    loss = (torch.maximum(-a * r, -a * torch.clamp(r, 1.0 - 0.02, 1.0 + 0.02)) / (-dt)).mean()
    assert out["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)
    assert_relative(got, grads_of(loss, stage), 1e-5)
    clipped = prepared.advantages.abs() > 5
    assert out["adv_clipped_frac"] == float(clipped.float().mean())
    u = prepared.advantages[:, None]
    unclipped = float((torch.maximum(-u * r, -u * r.clamp(0.98, 1.02)) / (-dt)).mean().detach())
    assert (abs(unclipped - out["loss"]) > 0.1 * abs(out["loss"])) == bool(clipped.any())


def test_guard_first_update_with_replayed_pi_old_is_exactly_on_policy():
    stage = LinearStage()
    algo = FlowGRPO(FlowGRPOConfig(guard=True, old_logp_source="replay"))
    prepared = algo.prepare_segment(stage, sampled_track(stage))
    out = algo.compute_loss_and_backward(stage, prepared, {"loss_scale": 1.0, "progress": 0.0})
    assert out["ratio/min"] == out["ratio/max"] == 1.0 and out["guard/bias"] == 0.0


def test_normalised_ratio_has_mean_zero_and_one_spread_at_every_step():
    """pi_old samples x' = mu_old + s_t eps at three steps whose noise differs 15-fold, with the
    same mean shift d = mu - mu_old: the raw log-ratio has mean -mean(d^2)/(2 s_t^2) and std
    ~ |d| / s_t; the normalised one mean 0 and std sqrt(mean(d^2) / n) at every step."""
    g = torch.Generator().manual_seed(0)
    m, n = 4000, 64
    s = torch.tensor([0.3, 0.1, 0.02])
    d = 0.01 * torch.randn(n, generator=g)
    mu_old = torch.randn(3, n, generator=g).expand(m, 3, n)
    mu = mu_old + d
    x = mu_old + s[None, :, None] * torch.randn(m, 3, n, generator=g)
    logp = gaussian_log_prob(x.flatten(0, 1), mu.flatten(0, 1), s.repeat(m)[:, None]).view(m, 3)
    logp_old = gaussian_log_prob(x.flatten(0, 1), mu_old.flatten(0, 1), s.repeat(m)[:, None]).view(m, 3)
    z, bias = guard_log_ratio(logp, logp_old, mu, mu_old, s)
    target_std = math.sqrt(float((d**2).mean()) / n)
    for t in range(3):
        raw = logp[:, t] - logp_old[:, t]
        assert float(raw.mean()) == pytest.approx(-float((d**2).mean()) / (2 * float(s[t]) ** 2), rel=0.1)
        assert float(raw.std()) == pytest.approx(target_std / float(s[t]), rel=0.1)
        assert abs(float(z[:, t].mean())) < 4 * target_std / math.sqrt(m)
        assert float(z[:, t].std()) == pytest.approx(target_std, rel=0.1)
        assert float(bias[0, t]) == pytest.approx(float((d**2).mean()) / (2 * float(s[t]) ** 2), rel=1e-5)


@pytest.mark.parametrize("sde", ["flow", "dance", "cps"])
def test_velocity_kl_of_the_step_losses_is_the_velocities_squared_distance(sde):
    stage = LinearStage(sde=sde)
    track = sampled_track(stage, eta=0.5)
    w_ref = stage.module.weight.data + 0.3
    ctx = {"reference": lambda: stage.swapped(w_ref)}
    for algo in (
        FlowGRPO(FlowGRPOConfig(beta=0.2, kl_space="velocity")),
        DPOK(DPOKConfig(beta=0.2, kl_space="velocity")),
    ):
        _, out, got = run(algo, stage, track, ctx)
        stage.module.zero_grad()
        logp, _, _, _, v = hand_replay(stage, track)
        with torch.no_grad(), stage.swapped(w_ref):
            v_ref = hand_replay(stage, track)[4]
        kl = ((v - v_ref) ** 2).flatten(2).mean(-1)
        assert out["kl"] == pytest.approx(float(kl.detach().mean()), rel=1e-4)
        perturb(stage, -0.05)  # back to the sampling weights for the next algorithm


def test_velocity_scale_is_the_means_coefficient_of_v():
    stage = LinearStage()
    track = sampled_track(stage, eta=0.7)
    sig, eta = track.segment.sigmas, 0.7
    got = velocity_scale(stage, track.segment, [1, 2, 3])
    for j, i in enumerate([1, 2, 3]):
        s, dt = float(sig[i]), float(sig[i + 1] - sig[i])
        std_dev_t = math.sqrt(s / (1 - s)) * eta
        assert float(got[j]) == pytest.approx((1 + std_dev_t**2 * (1 - s) / (2 * s)) * dt, rel=1e-5)


def test_kl_space_errors_name_the_key():
    with pytest.raises(ValueError, match="algorithm.config.kl_space"):
        FlowGRPOConfig(kl_space="score")


@pytest.mark.parametrize("space", ["velocity", "latent"])
def test_reward_backprop_regulariser_in_both_spaces(space):
    stage = LinearStage()
    track = sampled_track(stage)
    w_ref = stage.module.weight.data - 0.2
    kl = velocity_kl(stage, track, lambda: stage.swapped(w_ref), 3, 0, space)
    got = float(kl.detach())
    kl.backward()
    assert all(p.grad is not None for p in stage.module.parameters())
    # the same positions drawn by hand: per sample, seeded by (seed, sample id, "kl")
    seg, rows = track.segment, []
    for b, sid in enumerate(track.sample_ids):
        for j in torch.randint(0, seg.num_steps, (3,), generator=sample_generator(0, sid, "kl")).tolist():
            x, s = seg.at(j)[b : b + 1], seg.sigmas[j]
            c = track.conditions["c"][b]
            with torch.no_grad():
                v = stage.module(x) * (1 + s) + c
                with stage.swapped(w_ref):
                    v_ref = stage.module(x) * (1 + s) + c
            d = float(((v - v_ref) ** 2).mean())
            rows.append(d if space == "velocity" else float(s) ** 2 * d)
    assert got == pytest.approx(sum(rows) / len(rows), rel=1e-5)
    with pytest.raises(ValueError, match="algorithm.config.kl_space"):
        RewardBackpropConfig(kl_space="score")
