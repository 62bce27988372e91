"""CRD's loss and gradient against the centred reward-matching loss written out here, for every
centering mode, with the reward-adaptive KL; the first update on the old snapshot; the config
errors (no Ray; a stand-in linear denoiser, `tests/algorithms/linear_stage.py`)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.algorithms.linear_stage import LinearStage, perturb, sampled_track
from tests.algorithms.test_dgpo import velocity
from unirl.algorithms.crd import CRD, OLD_SNAPSHOT, CRDConfig

ADV = torch.tensor([1.2, -0.4, -1.0, 0.2, -0.7, 0.9, 1.5, -1.7])
REWARDS = torch.tensor([0.9, 0.5, 0.2, 0.6, 0.3, 0.8, 0.95, 0.1])


def track8(stage):
    track = sampled_track(stage, n=8)
    return dataclasses.replace(
        track, group_ids=[f"g{i // 4}" for i in range(8)], advantages=ADV.clone(), rewards=REWARDS.clone()
    )


def hand_weights(a: list[float], mode: str, tau: float) -> tuple[list[float], list[float]]:
    """Centring weights of one group, from plain Python numbers."""
    n = len(a)
    if mode == "uniform":
        return [1 / n] * n, [1 / n] * n
    if mode == "softmax":
        ep = [math.exp(x / tau) for x in a]
        en = [math.exp(-x / tau) for x in a]
        return [e / sum(ep) for e in ep], [e / sum(en) for e in en]
    pos = [x > 0 for x in a]
    neg = [x < 0 for x in a]
    wp = [p / sum(pos) for p in pos] if any(pos) else [1 / n] * n
    wn = [q / sum(neg) for q in neg] if any(neg) else [1 / n] * n
    return wp, wn


def hand_loss(stage, track, prepared, cfg, weight, old, ref):
    s = prepared.conditions["crd/sigma"].reshape(-1)
    eps = prepared.conditions["crd/noise"].flatten(0, 1)
    x0 = track.segment.final
    x_s = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps
    c = track.conditions["c"]
    v = velocity(stage, weight, x_s, s, c)
    with torch.no_grad():
        err_old = ((velocity(stage, old, x_s, s, c) - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
        v_ref = velocity(stage, ref, x_s, s, c)
    err = ((v - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
    a = track.advantages.clamp(-cfg.adv_clip, cfg.adv_clip)
    loss = 0
    for g in range(2):
        m = list(range(4 * g, 4 * g + 4))
        rho = [cfg.reward_beta * (err_old[i] - err[i]) for i in m]
        tgt = [float(a[i]) for i in m]
        for w in hand_weights(tgt, cfg.centering, cfg.temperature):
            rho_c = sum(wj * r for wj, r in zip(w, rho, strict=True))
            tgt_c = sum(wj * t for wj, t in zip(w, tgt, strict=True))
            for r, t in zip(rho, tgt, strict=True):
                loss = loss + 0.5 * ((r - rho_c) - (t - tgt_c)) ** 2
    loss = loss / 8
    kl = ((v - v_ref) ** 2).mean()
    return loss + cfg.kl_beta * min(max(float(REWARDS.mean()), 0.0), 1.0) * kl


@pytest.mark.parametrize("centering", ["uniform", "hard", "softmax"])
def test_loss_and_gradient_match_the_centred_matching_loss(centering):
    stage = LinearStage()
    track = track8(stage)
    adv = ADV.clone()
    adv[4:] = torch.tensor([0.7, 0.9, 1.5, 0.4])  # an all-positive group: hard's negative pool is empty
    track = dataclasses.replace(track, advantages=adv)
    cfg = CRDConfig(
        reward_beta=30.0,
        centering=centering,
        temperature=0.7,
        kl_beta=0.2,
        adv_clip=1.3,
        timestep_range=(0.0, 1.0),
    )
    algo = CRD(cfg)
    ref = stage.module.weight.detach().clone()
    prepared = algo.prepare_segment(stage, track)
    perturb(stage, 0.2)
    old = stage.module.weight.detach().clone()
    perturb(stage, 0.1, seed=7)
    weight = stage.module.weight.detach().clone()
    ctx = {
        "loss_scale": 1.0,
        "reference": lambda: stage.swapped(ref),
        "snapshots": {OLD_SNAPSHOT: lambda: stage.swapped(old)},
    }
    stage.module.zero_grad()
    out = algo.compute_loss_and_backward(stage, prepared, ctx)
    w = weight.clone().requires_grad_(True)
    want = hand_loss(stage, track, prepared, cfg, w, old, ref)
    want.backward()
    assert out["loss"] == pytest.approx(float(want.detach()), rel=1e-5)
    assert out["crd/kl_coef"] == pytest.approx(0.2 * float(REWARDS.mean()))
    torch.testing.assert_close(stage.module.weight.grad, w.grad, rtol=1e-4, atol=1e-7)


def test_modes_differ_and_the_normaliser_cancels():
    """A constant added to a group's implicit rewards (its log Z) changes no mode's loss; the
    three modes give three different losses on mixed-sign groups."""
    from unirl.algorithms.crd import centred_match_loss

    gids = [f"g{i // 4}" for i in range(8)]
    delta = torch.randn(8, generator=torch.Generator().manual_seed(0))
    shifted = delta + torch.tensor([3.0] * 4 + [-2.0] * 4)
    losses = []
    for mode in ("uniform", "hard", "softmax"):
        base = centred_match_loss(delta, ADV, gids, mode, 0.5)
        assert float(centred_match_loss(shifted, ADV, gids, mode, 0.5)) == pytest.approx(
            float(base), rel=1e-5
        )
        losses.append(float(base))
    assert len({round(x, 6) for x in losses}) == 3


def test_first_update_at_the_old_snapshot_is_advantage_weighted_matching():
    """With the policy at the old snapshot rho = 0: the gradient is 2 reward_beta / B sum_i A_c,i grad l_i
    (uniform centring, no KL)."""
    stage = LinearStage()
    track = track8(stage)
    algo = CRD(CRDConfig(reward_beta=10.0, kl_beta=0.0, timestep_range=(0.0, 1.0)))
    prepared = algo.prepare_segment(stage, track)
    same = stage.module.weight.detach().clone()
    stage.module.zero_grad()
    out = algo.compute_loss_and_backward(
        stage, prepared, {"loss_scale": 1.0, "snapshots": {OLD_SNAPSHOT: lambda: stage.swapped(same)}}
    )
    assert out["crd/implicit_reward_mean"] == 0.0
    s = prepared.conditions["crd/sigma"].reshape(-1)
    eps = prepared.conditions["crd/noise"].flatten(0, 1)
    x0 = track.segment.final
    x_s = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps
    w = same.clone().requires_grad_(True)
    err = ((velocity(stage, w, x_s, s, track.conditions["c"]) - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
    a_c = ADV - ADV.view(2, 4).mean(1).repeat_interleave(4)
    (2 * 10.0 * (a_c * err).sum() / 8).backward()
    torch.testing.assert_close(stage.module.weight.grad, w.grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"reward_beta": 0.0}, "algorithm.config.reward_beta"),
        ({"centering": "median"}, "algorithm.config.centering"),
        ({"temperature": -1.0}, "algorithm.config.temperature"),
        ({"old_decay": (0, 0.25, -0.005, 0.999)}, "algorithm.config.old_decay"),
        ({"old_decay": (0, 0.25, 0.005)}, "algorithm.config.old_decay"),
        ({"kl_beta": -0.1}, "algorithm.config.kl_beta"),
        ({"kl_guidance_scale": 0.0}, "algorithm.config.kl_guidance_scale"),
    ],
)
def test_bad_config_names_the_key(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        CRDConfig(**kwargs)


def test_snapshot_schedule_is_the_papers():
    from unirl.train.ema import EMA, EMAConfig

    spec = CRD(CRDConfig()).snapshots[OLD_SNAPSHOT]
    ema = EMA([("w", torch.nn.Parameter(torch.zeros(1)))], EMAConfig(**spec))
    assert [ema.decay_at(t) for t in (0, 1, 100, 200)] == pytest.approx([0.25, 0.255, 0.75, 0.999])
    sampling = EMA(
        [("w", torch.nn.Parameter(torch.zeros(1)))],
        EMAConfig(decay=0.999, schedule="linear", warmup_steps=75, decay_slope=0.0075, update_on="rollout"),
    )
    assert [sampling.decay_at(t) for t in (0, 74, 75, 76, 300)] == pytest.approx([0, 0, 0, 0.0075, 0.999])
