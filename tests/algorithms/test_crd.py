"""CRD's loss and gradient against Flow-Factory's equations written out here (`trainers/crd.py`,
`CRDTrainer.optimize` and `_compute_crd_loss`), for every centring mode, both loss types, with
and without `adaptive_logp` and the reward-adaptive KL, one and several draws; the centre's
stop-gradient; log Z cancelling; the first update on the old snapshot; the config errors (no
Ray; a stand-in linear denoiser, `tests/algorithms/linear_stage.py`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from tests.algorithms.linear_stage import LinearStage, assert_relative, perturb, sampled_track
from tests.algorithms.test_dgpo import velocity
from unirl.algorithms.crd import CRD, OLD_SNAPSHOT, CRDConfig

ADV = torch.tensor([1.2, -0.4, -1.0, 0.2, -0.7, 0.9, 1.5, -1.7])


def track8(stage, adv=ADV):
    track = sampled_track(stage, n=8)
    return dataclasses.replace(track, group_ids=[f"g{i // 4}" for i in range(8)], advantages=adv.clone())


def reference_group_loss(adv_cur, r_theta, beta, weight_temp, loss_type, hard_pools=False):
    """Flow-Factory's `_compute_crd_loss` on one group (adv_cur the normalised advantages [n],
    r_theta the implicit rewards [n]): uniform (weight_temp < 0, one direction) or softmax
    (weight_temp > 0, two directions averaged); the centre carries no gradient. `hard_pools`:
    UniRL's `hard` centring instead (uniform over A > 0 and over A < 0, adv_cur > 1/2 and < 1/2;
    Flow-Factory's weight_temp 0 differs, see `unirl/algorithms/crd.py`)."""

    def direction(p):
        rc = adv_cur - (adv_cur * p).sum(dim=0, keepdim=True)
        r_c = r_theta - (r_theta * p).sum(dim=0, keepdim=True).detach()
        if loss_type == "bce":
            return F.binary_cross_entropy_with_logits(beta * r_c, torch.sigmoid(rc.detach()), reduction="mean")
        return ((beta * r_c - rc) ** 2).mean()

    n = len(adv_cur)
    if hard_pools:
        pools = [adv_cur > 0.5, adv_cur < 0.5]
        p_plus, p_minus = [m.float() / m.sum() if m.any() else torch.full((n,), 1 / n) for m in pools]
    elif weight_temp < 0:
        return direction(torch.softmax(adv_cur / torch.inf, dim=0))
    else:
        p_plus = torch.softmax(adv_cur / weight_temp, dim=0)
        p_minus = torch.softmax(-adv_cur / weight_temp, dim=0)
    return 0.5 * direction(p_plus) + 0.5 * direction(p_minus)


def reference_loss(stage, track, prepared, cfg, weight, old, ref):
    """Flow-Factory's CRD loss per drawn timestep, averaged over the draws (its gradient
    accumulation over timesteps), centred within each group of 4 (the mean over the batch of
    each group's own Flow-Factory loss)."""
    temp = {"uniform": -1.0, "softmax": cfg.temperature, "hard": None}[cfg.centering]
    c = cfg.adv_clip
    adv = track.advantages.clamp(-c, c)
    adv_rank = torch.clamp(adv / c / 2.0 + 0.5, 0, 1)
    x0, cond = track.segment.final, track.conditions["c"]
    losses = []
    for j in range(cfg.draws_per_sample):
        s = prepared.conditions["crd/sigma"][:, j]
        noise = prepared.conditions["crd/noise"][:, j]
        x_s = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * noise
        v_target = noise - x0
        forward_pred = velocity(stage, weight, x_s, s, cond)
        with torch.no_grad():
            old_v_pred = velocity(stage, old, x_s, s, cond)
            ref_pred = velocity(stage, ref, x_s, s, cond)
        if cfg.adaptive_logp:
            with torch.no_grad():
                weight_theta = torch.abs(forward_pred.double() - v_target.double()).mean(
                    dim=(1, 2, 3), keepdim=True
                ).clip(min=1e-5)
                weight_old = torch.abs(old_v_pred.double() - v_target.double()).mean(
                    dim=(1, 2, 3), keepdim=True
                ).clip(min=1e-5)
            r_theta = -((forward_pred - v_target) ** 2 / weight_theta - (old_v_pred - v_target) ** 2 / weight_old)
        else:
            r_theta = -((forward_pred - v_target) ** 2 - (old_v_pred - v_target) ** 2)
        r_local = r_theta.mean(dim=(1, 2, 3))
        groups = [
            reference_group_loss(
                adv_rank[g * 4 : g * 4 + 4], r_local[g * 4 : g * 4 + 4], cfg.beta, temp, cfg.loss_type, temp is None
            )
            for g in range(2)
        ]
        policy_loss = torch.stack(groups).mean() * c / cfg.beta
        kl_div = ((forward_pred - ref_pred) ** 2).mean(dim=(1, 2, 3))
        if cfg.kl_reward_adaptive:
            min_coef = 1e-4 / cfg.kl_beta
            kl_loss = cfg.kl_beta * torch.mean((min_coef + adv_rank * (1 - min_coef)) * kl_div)
        else:
            kl_loss = cfg.kl_beta * kl_div.mean()
        losses.append(policy_loss + kl_loss)
    return torch.stack(losses).mean()


def run_both(cfg, adv=ADV):
    """CRD's loss and gradient and the reference's, off the old snapshot and the reference."""
    stage = LinearStage()
    track = track8(stage, adv)
    algo = CRD(cfg)
    ref = stage.module.weight.detach().clone()
    prepared = algo.prepare_segment(stage, track)
    perturb(stage, 0.2)
    old = stage.module.weight.detach().clone()
    with torch.no_grad():
        stage.module.weight.add_(0.1 * torch.randn(old.shape, generator=torch.Generator().manual_seed(7)))
    weight = stage.module.weight.detach().clone()
    ctx = {
        "loss_scale": 1.0,
        "reference": lambda: stage.swapped(ref),
        "snapshots": {OLD_SNAPSHOT: lambda: stage.swapped(old)},
    }
    stage.module.zero_grad()
    out = algo.compute_loss_and_backward(stage, prepared, ctx)
    w = weight.clone().requires_grad_(True)
    want = reference_loss(stage, track, prepared, cfg, w, old, ref)
    want.backward()
    return out, stage.module.weight.grad.clone(), float(want.detach()), w.grad


@pytest.mark.parametrize("draws", [1, 2])
@pytest.mark.parametrize("loss_type", ["mse", "bce"])
@pytest.mark.parametrize("centering", ["uniform", "hard", "softmax"])
def test_loss_and_gradient_match_flow_factorys(centering, loss_type, draws):
    adv = ADV.clone()
    adv[4:] = torch.tensor([0.7, 0.9, 1.5, 0.4])  # an all-positive group: hard's negative pool is empty
    cfg = CRDConfig(
        beta=3.0,
        loss_type=loss_type,
        centering=centering,
        temperature=0.7,
        kl_beta=0.2,
        adv_clip=1.3,
        draws_per_sample=draws,
        timestep_range=(0.0, 1.0),
    )
    out, grad, want, want_grad = run_both(cfg, adv)
    assert out["loss"] == pytest.approx(want, rel=1e-5)
    assert_relative([grad], [want_grad], 1e-5)
    assert grad.abs().sum() > 0


@pytest.mark.parametrize("adaptive_logp", [True, False])
@pytest.mark.parametrize("kl_reward_adaptive", [True, False])
def test_adaptive_logp_and_kl_match_flow_factorys(adaptive_logp, kl_reward_adaptive):
    cfg = CRDConfig(
        beta=2.0,
        adaptive_logp=adaptive_logp,
        kl_reward_adaptive=kl_reward_adaptive,
        kl_beta=0.05,
        timestep_range=(0.0, 1.0),
    )
    out, grad, want, want_grad = run_both(cfg)
    assert out["loss"] == pytest.approx(want, rel=1e-5)
    assert_relative([grad], [want_grad], 1e-5)
    floor = 1e-4 / 0.05
    adv_rank = (ADV / 5 / 2 + 0.5).clamp(0, 1)
    coef = floor + adv_rank * (1 - floor) if kl_reward_adaptive else torch.ones(8)
    assert out["crd/kl_coef"] == pytest.approx(0.05 * float(coef.mean()), rel=1e-6)


def test_the_centre_carries_no_gradient():
    """Differentiating through the softmax centre (the earlier form) gives another gradient."""
    from unirl.algorithms import crd as crd_module

    cfg = CRDConfig(
        beta=3.0, centering="softmax", temperature=0.7, kl_beta=0.0, kl_reward_adaptive=False,
        timestep_range=(0.0, 1.0),
    )
    _, grad, _, want_grad = run_both(cfg)
    assert_relative([grad], [want_grad], 1e-5)
    real = crd_module.centred_match_loss

    def through_centre(rho, a, gids, beta, mode, temperature=1.0, loss_type="mse"):
        idx = torch.tensor([int(g[1:]) for g in gids])
        total = rho.new_zeros(())
        for gi in range(2):
            r, t = rho[idx == gi], a[idx == gi]
            for w in crd_module.centering_weights(t, mode, temperature):
                total = total + 0.5 * ((beta * (r - (w * r).sum()) - (t - (w * t).sum())) ** 2).sum()
        return total / len(rho)

    crd_module.centred_match_loss = through_centre
    try:
        _, other, _, _ = run_both(cfg)
    finally:
        crd_module.centred_match_loss = real
    assert not torch.allclose(other, want_grad, rtol=1e-2)


def test_modes_differ_and_the_normaliser_cancels():
    """A constant added to a group's implicit rewards (its log Z) changes no mode's loss; the
    three modes give three different losses on mixed-sign groups."""
    from unirl.algorithms.crd import centred_match_loss, normalised_advantages

    gids = [f"g{i // 4}" for i in range(8)]
    rho = torch.randn(8, generator=torch.Generator().manual_seed(0))
    shifted = rho + torch.tensor([3.0] * 4 + [-2.0] * 4)
    a = normalised_advantages(ADV, 2.0)
    losses = []
    for mode in ("uniform", "hard", "softmax"):
        base = centred_match_loss(rho, a, gids, 1.5, mode, 0.5)
        assert float(centred_match_loss(shifted, a, gids, 1.5, mode, 0.5)) == pytest.approx(float(base), rel=1e-5)
        losses.append(float(base))
    assert len({round(x, 6) for x in losses}) == 3


def test_first_update_at_the_old_snapshot_is_advantage_weighted_matching():
    """With the policy at the old snapshot rho = 0 (no adaptive_logp): the gradient is
    2c / B sum_i a_c,i grad l_i = 1/B sum_i A_c,i grad l_i (uniform centring, no KL), whatever beta."""
    stage = LinearStage()
    track = track8(stage)
    algo = CRD(CRDConfig(beta=10.0, adaptive_logp=False, kl_beta=0.0, timestep_range=(0.0, 1.0)))
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
    ((a_c * err).sum() / 8).backward()
    assert_relative([stage.module.weight.grad], [w.grad], 1e-5)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"beta": 0.0}, "algorithm.config.beta"),
        ({"loss_type": "l1"}, "algorithm.config.loss_type"),
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
