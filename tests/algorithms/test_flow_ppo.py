"""Flow-PPO (a per-step critic for diffusion): GAE over the SDE steps against the recurrence
written out here, the critic's values lined up with the steps they value, per-step advantages
reaching their own steps in Flow-GRPO's clipped loss, the first update's ratio exactly 1, value
normalization round trips, the driver's view of `segment.values` alone, and the settings a
diffusion critic refuses. Milliseconds: the linear stand-in stage, a width-8 value network."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.algorithms.linear_stage import LinearStage, perturb, sampled_track
from unirl.algorithms.advantages import step_inputs, track_advantages, track_value_targets
from unirl.algorithms.flow_grpo import FlowGRPOConfig
from unirl.algorithms.flow_ppo import FlowPPO, FlowPPOConfig
from unirl.algorithms.ppo import ValueLoss, ValueNorm
from unirl.dataplane.codec import flatten, unflatten
from unirl.models.flow.value import FlowValueNet, FlowValueStage
from unirl.sde.strategies import make_strategy
from unirl.types import AdvantageConfig

GAMMA, LAM = 0.9, 0.8
REWARDS = [0.7, -0.2, 0.4, 1.1]


def valued_track(k_steps=(1, 2, 3), seed: int = 0):
    """A sampled track of 4 samples with rewards, a prompt embedding and per-step values."""
    track = sampled_track(LinearStage(), sde_indices=k_steps)
    g = torch.Generator().manual_seed(seed)
    track.conditions["emb"] = torch.randn(4, 5, generator=g)
    track.segment.values = torch.randn(4, len(k_steps), generator=g)
    track.rewards = torch.tensor(REWARDS)
    return track


def hand_gae(values: list[list[float]], rewards: list[float]) -> tuple[list[list[float]], list[list[float]]]:
    """delta_k = R_k + gamma V_{k+1} - V_k (R_k = r on the last step only, V_K = 0),
    A_k = delta_k + gamma lam A_{k+1}; returns A_k + V_k."""
    advs, rets = [], []
    for v, r in zip(values, rewards, strict=True):
        n, a, nxt = len(v), [0.0] * len(v), 0.0
        for k in range(n - 1, -1, -1):
            delta = (r if k == n - 1 else 0.0) + GAMMA * (v[k + 1] if k + 1 < n else 0.0) - v[k]
            nxt = delta + GAMMA * LAM * nxt
            a[k] = nxt
        advs.append(a)
        rets.append([a[k] + v[k] for k in range(n)])
    return advs, rets


def test_gae_over_sde_steps_matches_the_recurrence_and_whitens_over_all_steps():
    track = valued_track()
    cfg = AdvantageConfig(estimator="gae", gamma=GAMMA, lam=LAM, eps=1e-6)
    advs, rets = hand_gae(track.segment.values.tolist(), REWARDS)
    flat = [a for row in advs for a in row]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((a - mean) ** 2 for a in flat) / len(flat))
    got, returns = track_advantages(track, cfg), track_value_targets(track, cfg)
    assert got.shape == returns.shape == (4, 3)  # one column per SDE step, in sde_indices order
    for i in range(4):
        assert got[i].tolist() == pytest.approx([(a - mean) / (std + 1e-6) for a in advs[i]], abs=1e-5)
        assert returns[i].tolist() == pytest.approx(rets[i], abs=1e-6)
    # lam 1, gamma 1: every step's return is the reward, its advantage r - V_k before whitening
    mc = track_value_targets(track, AdvantageConfig(estimator="gae"))
    assert torch.allclose(mc, torch.tensor(REWARDS)[:, None].expand(4, 3))
    track.segment.values = None
    with pytest.raises(ValueError, match="needs per-step values"):
        track_advantages(track, cfg)


def test_critic_values_line_up_with_the_steps_they_value():
    """values[:, k] is V(x_{i_k}, sigma_{i_k}, prompt) of sample i's own state, whatever batch it sits in."""
    track = valued_track(k_steps=(0, 2, 4))
    torch.manual_seed(0)
    stage = FlowValueStage(FlowValueNet(2, 5, width=8), "emb")
    seg = track.segment
    with torch.no_grad():
        values = stage.values(track)
        assert values.shape == (4, 3) and values.dtype == torch.float32
        for k, i in enumerate(seg.sde_indices):
            step = stage.module(seg.at(i), seg.sigmas[i].expand(4), track.conditions["emb"])
            assert torch.allclose(values[:, k], step, atol=1e-6)
        assert torch.allclose(stage.values(track.select([2, 3])), values[2:], atol=1e-6)
        # a [B, L, D] token embedding is averaged over its tokens
        tokens = track.conditions["emb"][:, None, :].expand(4, 3, 5)
        track.conditions["tok"] = tokens
        assert torch.allclose(FlowValueStage(stage.module, "tok").values(track), values, atol=1e-6)
    with pytest.raises(ValueError, match="critic.model.cond_key='nope'"):
        FlowValueStage(stage.module, "nope").values(track)


def test_per_step_advantages_reach_their_own_steps_and_the_first_ratio_is_one():
    stage = LinearStage()
    track = valued_track()
    adv = torch.tensor([[1.0, -2.0, 0.5], [0.3, 0.0, -1.0], [-0.7, 1.5, 2.0], [0.2, -0.4, 0.9]])
    track.advantages = adv
    algo = FlowPPO(FlowPPOConfig(clip_range=0.05))
    perturb(stage)  # the rollout's log-probs are no longer the current policy's
    prepared = algo.prepare_segment(stage, track)  # pi_old replayed: the first ratio is exactly 1
    out = algo.compute_loss_and_backward(stage, prepared, {"loss_scale": 1.0, "progress": 0.0})
    assert out["ratio/min"] == out["ratio/max"] == 1.0
    stage.module.zero_grad()
    perturb(stage, seed=9)  # a later update: ratios move, some beyond the clip range
    out = algo.compute_loss_and_backward(stage, prepared, {"loss_scale": 1.0, "progress": 0.0})
    seg = prepared.segment
    strategy = make_strategy("flow", seg.eta)
    want = []
    for k, i in enumerate(seg.sde_indices):  # written out per step, no grad
        torch.set_grad_enabled(False)
        x = seg.at(i)
        v = stage.velocity(x, seg.sigmas[i].expand(4), prepared.conditions, 1.0)
        lp = strategy.step(x, v, seg.sigmas, i, sde=True, next_sample=seg.at(i + 1)).log_prob
        ratio = torch.exp(lp - seg.log_probs[:, k])
        a = adv[:, k]
        want.append(torch.maximum(-a * ratio, -a * ratio.clamp(0.95, 1.05)))
    torch.set_grad_enabled(True)
    assert out["ratio/min"] < 0.95 or out["ratio/max"] > 1.05  # the clip binds somewhere
    assert out["policy_loss"] == pytest.approx(float(torch.stack(want, 1).mean()), rel=1e-5)
    # the same advantages on the wrong steps give another loss: columns are not interchangeable
    swapped = dataclasses.replace(prepared, advantages=adv[:, [2, 0, 1]])
    other = algo.compute_loss_and_backward(stage, swapped, {"loss_scale": 1.0, "progress": 0.0})
    assert other["policy_loss"] != pytest.approx(out["policy_loss"], rel=1e-3)


def test_value_loss_under_value_norm_and_norm_statistics():
    norm = ValueNorm(0.5)
    assert norm.mean == 0.0 and norm.std == 1.0  # identity before the first update
    norm.update(torch.tensor([1.0, 3.0]))
    norm.update(torch.tensor([5.0, 5.0]))
    # debiased EMAs: m = .5 (.5 * 2) + .5 * 5 = 3, q = .5 (.5 * 5) + .5 * 25 = 13.75, w = .75
    assert norm.mean == pytest.approx(3.0 / 0.75) and norm.std == pytest.approx(
        math.sqrt(13.75 / 0.75 - 16.0)
    )
    x = torch.tensor([0.3, -2.0])
    assert torch.allclose(norm.denormalize(norm.normalize(x)), x)
    back = ValueNorm(0.5)
    back.load_state_dict(norm.state_dict())
    assert (back.mean, back.std) == (norm.mean, norm.std)
    with pytest.raises(ValueError, match=r"critic.value_norm_beta must be in \(0, 1\)"):
        ValueNorm(1.0)
    # the loss on normalized outputs: 0.5 (p - (R - mu) / sigma)^2 where no clip binds
    track = valued_track()
    cfg = AdvantageConfig(estimator="gae", gamma=GAMMA, lam=LAM)
    loss_fn = ValueLoss(cfg, cliprange_value=100.0, norm=norm)
    target = norm.normalize(track_value_targets(track, cfg))

    class Table:
        def __init__(self):
            self.module = torch.nn.Module()
            self.module.v = torch.nn.Parameter(torch.zeros(4, 3))

        def values(self, _track):
            return self.module.v

    table = Table()
    out = loss_fn.compute_loss_and_backward(table, loss_fn.prepare_segment(table, track), {"loss_scale": 1.0})
    assert out["vf_loss"] == pytest.approx(float(0.5 * target.square().mean()), rel=1e-5)
    assert torch.allclose(table.module.v.grad, -target / 12, atol=1e-6)
    assert out["vpred_mean"] == pytest.approx(norm.mean)  # reported in reward units
    assert loss_fn.state_dict() == {"value_norm": norm.state_dict()}


def test_driver_fetches_segment_values_alone():
    """`segment.values` alone gives a partial segment holding the values (not the latents)."""
    track = valued_track()
    fields, skeleton = flatten(track)
    view = unflatten(
        skeleton, {k: fields[k] for k in ("sample_ids", "group_ids", "segment.values")}, partial=True
    )
    assert torch.equal(view.segment.values, track.segment.values) and view.segment.latents is None
    got = step_inputs(view)
    assert torch.equal(got["values"], track.segment.values) and torch.equal(got["mask"], torch.ones(4, 3))


def test_flow_ppo_settings():
    with pytest.raises(ValueError, match="FlowPPO trains on the critic's per-step GAE advantages"):
        FlowPPO().check_advantage(AdvantageConfig())
    with pytest.raises(ValueError, match="advantage.kl_coef=0.1: a diffusion track has no per-step KL"):
        FlowPPO().check_advantage(AdvantageConfig(estimator="gae", kl_coef=0.1))
    assert FlowPPO().config.old_logp_source == "replay" and FlowPPO.uses_values
    assert isinstance(FlowPPO().config, FlowGRPOConfig)
