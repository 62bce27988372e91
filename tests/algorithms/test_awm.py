"""AWM's loss and gradient against the formula written out here, for every weighting, with and
without the clip, with its KL terms in both spaces; the first update on policy; the errors
(no Ray; a stand-in linear denoiser, `tests/algorithms/linear_stage.py`)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.algorithms.linear_stage import LinearStage, perturb, sampled_track
from unirl.algorithms.awm import AWM, W_OLD_KEY, AWMConfig

E = 1e-10


def hand_weight(err, s, weighting, p=0.25):
    """The paper's weightings of the per-row matching error err at noise level s."""
    return {
        "uniform": lambda: err,
        "t": lambda: s * err,
        "t**2": lambda: s * s * err,
        "huber": lambda: s * ((err + E) ** 0.5 - E**0.5),
        "ghuber": lambda: s / p * ((err + E) ** p - E**p),
    }[weighting]()


def hand_loss(stage, track, prepared, cfg, v_ema=None, v_ref=None):
    """The AWM loss from the prepared draws, computed independently of the module under test."""
    k = cfg.draws_per_sample
    s = prepared.conditions["awm/sigma"].reshape(-1)
    eps = prepared.conditions["awm/noise"].flatten(0, 1)
    x0 = track.segment.final.repeat_interleave(k, dim=0)
    x_s = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps
    c = track.conditions["c"].repeat_interleave(k)
    v = stage.module(x_s) * (1 + s.view(-1, 1, 1, 1)) + c.view(-1, 1, 1, 1)
    err = ((v - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
    w = hand_weight(err, s, cfg.weighting, cfg.ghuber_power)
    w_old = prepared.conditions[W_OLD_KEY].reshape(-1)
    a = track.advantages.clamp(-cfg.adv_clip, cfg.adv_clip).repeat_interleave(k)
    r = torch.exp(w_old - w)
    if cfg.clip_range is None:
        loss = (-a * r).mean()
    else:
        loss = torch.maximum(-a * r, -a * r.clamp(1 - cfg.clip_range, 1 + cfg.clip_range)).mean()
    scale = s**2 if cfg.kl_space == "latent" else torch.ones_like(s)
    for coef, other in ((cfg.ema_kl_beta, v_ema), (cfg.beta, v_ref)):
        if coef > 0:
            loss = loss + coef * (scale * ((v - other) ** 2).mean(dim=(1, 2, 3))).mean()
    return loss


def run(cfg, moved=0.2, ctx_extra=None):
    stage = LinearStage()
    track = sampled_track(stage, n=4)
    algo = AWM(cfg)
    prepared = algo.prepare_segment(stage, track)
    perturb(stage, moved)
    ctx = {"loss_scale": 1.0, **(ctx_extra(stage) if ctx_extra else {})}
    stage.module.zero_grad()
    out = algo.compute_loss_and_backward(stage, prepared, ctx)
    got = [p.grad.clone() for p in stage.module.parameters()]
    return stage, track, prepared, out, got


@pytest.mark.parametrize("weighting", ["uniform", "t", "t**2", "huber", "ghuber"])
@pytest.mark.parametrize("clip", [None, 0.02])
def test_loss_and_gradient_match_the_formula(weighting, clip):
    cfg = AWMConfig(
        weighting=weighting,
        clip_range=clip,
        allow_unconstrained=clip is None,
        draws_per_sample=2,
        timestep_distribution="logit_normal",
        timestep_shift=3.0,
        adv_clip=1.8,
        ghuber_power=0.5 if weighting == "ghuber" else 0.25,
    )
    stage, track, prepared, out, got = run(cfg)
    stage.module.zero_grad()
    expected = hand_loss(stage, track, prepared, cfg)
    expected.backward()
    assert out["loss"] == pytest.approx(float(expected.detach()), rel=1e-5, abs=1e-7)
    for g, p in zip(got, stage.module.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
    if clip is not None:  # weights moved by 0.2: some rows outside [1 - clip, 1 + clip]
        assert 0 < out["clipfrac"] <= 1


@pytest.mark.parametrize("space", ["velocity", "latent"])
def test_kl_to_the_ema_and_the_reference_match_the_formula(space):
    cfg = AWMConfig(ema_kl_beta=0.3, beta=0.05, kl_space=space, weighting="t")
    w_ema, w_ref = torch.randn(2, 2, 1, 1, generator=torch.Generator().manual_seed(5)) * 0.5

    def ctx(stage):
        return {"ema": lambda: stage.swapped(w_ema), "reference": lambda: stage.swapped(w_ref)}

    stage, track, prepared, out, got = run(cfg, ctx_extra=ctx)
    x_t, _, sigma, cond = AWM(cfg).inputs(prepared)
    with torch.no_grad():
        with stage.swapped(w_ema):
            v_ema = stage.velocity(x_t, sigma, cond, 1.0)
        with stage.swapped(w_ref):
            v_ref = stage.velocity(x_t, sigma, cond, 1.0)
    stage.module.zero_grad()
    hand_loss(stage, track, prepared, cfg, v_ema, v_ref).backward()
    for g, p in zip(got, stage.module.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-6)
    assert out["ema_kl"] > 0 and out["kl"] > 0


def test_first_update_is_on_policy_and_its_gradient_is_advantage_weighted_matching():
    """At the sampling weights r = 1 exactly and the gradient is mean(A grad w)."""
    cfg = AWMConfig(weighting="t", clip_range=1e-5)
    stage, track, prepared, out, got = run(cfg, moved=0.0)
    assert out["ratio/mean"] == out["ratio/min"] == out["ratio/max"] == 1.0
    x_t, _, sigma, cond = AWM(cfg).inputs(prepared)
    stage.module.zero_grad()
    err = ((stage.velocity(x_t, sigma, cond, 1.0) - AWM(cfg).target(prepared)) ** 2).mean(dim=(1, 2, 3))
    (track.advantages * sigma * err).mean().backward()
    for g, p in zip(got, stage.module.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=1e-5, atol=1e-7)


def test_unconstrained_awm_is_refused_unless_opted_in():
    with pytest.raises(ValueError, match="neither constraint.*allow_unconstrained"):
        AWMConfig(clip_range=None)
    AWMConfig(clip_range=None, allow_unconstrained=True)
    AWMConfig(clip_range=None, ema_kl_beta=0.1)
    AWMConfig(clip_range=None, beta=0.01)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"weighting": "t**3"}, "weighting"),
        ({"ghuber_power": 0.0}, "ghuber_power"),
        ({"clip_range": 1.5}, "clip_range"),
        ({"adv_clip": 0.0}, "adv_clip"),
        ({"ema_kl_beta": -1.0}, "ema_kl_beta"),
        ({"beta": math.nan}, "beta"),
        ({"kl_space": "score"}, "kl_space"),
        ({"timestep_range": (0.9, 0.1)}, "timestep_range"),
    ],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"algorithm.config.{key}"):
        AWMConfig(**kwargs)


def test_loss_needs_advantages_a_prepared_track_and_the_ema():
    stage = LinearStage()
    track = sampled_track(stage)
    algo = AWM(AWMConfig(ema_kl_beta=0.1))
    assert algo.needs_ema and not algo.needs_reference_policy
    with pytest.raises(ValueError, match="not prepared"):
        algo.compute_loss_and_backward(stage, track, {"loss_scale": 1.0})
    with pytest.raises(ValueError, match="train.ema"):
        algo.compute_loss_and_backward(stage, algo.prepare_segment(stage, track), {"loss_scale": 1.0})
    track.advantages = None
    with pytest.raises(ValueError, match="no advantages"):
        algo.compute_loss_and_backward(stage, algo.prepare_segment(stage, track), {"loss_scale": 1.0})
