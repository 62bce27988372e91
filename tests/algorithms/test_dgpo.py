"""DGPO's loss and gradient against the official code's equations written out here (frozen and
EMA references, the KL, the clip on kept and clipped rows, one and several draws), its group
scores on one worker and on two (the track split as the data-parallel scatter splits it), and
its config errors (no Ray; a stand-in linear denoiser, `tests/algorithms/linear_stage.py`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import unirl.algorithms.dgpo as dgpo_module
from tests.algorithms.linear_stage import LinearStage, assert_relative, perturb, sampled_track
from unirl.algorithms.dgpo import DGPO, EMA_REFERENCE, DGPOConfig
from unirl.distributed.group.dispatch import split_for_ranks

ADV = torch.tensor([1.2, -0.4, -1.0, 0.2, -0.7, 0.9, 1.5, -1.7])


def track8(stage):
    """8 samples in 2 prompt groups of 4, mixed-sign advantages."""
    track = sampled_track(stage, n=8)
    return dataclasses.replace(track, group_ids=[f"g{i // 4}" for i in range(8)], advantages=ADV.clone())


def velocity(stage, weight, x, s, c):
    """The linear stage's velocity with a given 1x1 weight, written out."""
    w = weight.view(weight.shape[0], weight.shape[1])
    y = torch.einsum("oc,bchw->bohw", w, x) + stage.module.bias.view(1, -1, 1, 1)
    return y * (1 + s.view(-1, 1, 1, 1)) + c.view(-1, 1, 1, 1)


def official_step_loss(model_v, ref_v, target, adv, groups, group_size, beta, old_v=None, clip=None):
    """One timestep's DGPO loss as Luo-Yihong/DGPO `scripts/train_sd3_dgpo.py` computes it
    (`compute_group_dgpo_loss_allreduce` and the clip in its training loop), on one process:
    S' = sum_{i in G} A_i beta (l_i - l_ref,i) / group_size, loss = mean_i sg(sigmoid(S'_G)) A_i l_i,
    the rows the clip stops (A > 0 and r > 1 + eps, else r < 1 - eps) trained on sg(l_i)."""
    b = model_v.shape[0]
    dsm = (target - model_v).square().reshape(b, -1).mean(dim=1)
    if clip is not None:
        old = (target - old_v).square().reshape(b, -1).mean(dim=1)
        ratio = torch.exp(-dsm + old)
        should_clip = torch.where(adv > 0, ratio > 1.0 + clip, ratio < 1.0 - clip)
        dsm = torch.where(should_clip, dsm.detach(), dsm)
    with torch.no_grad():
        ref = (target - ref_v).square().reshape(b, -1).mean(dim=1)
    per_sample = adv * beta * (dsm.detach() - ref) / group_size
    sums = torch.zeros(int(groups.max()) + 1).scatter_add_(0, groups, per_sample)
    return (torch.sigmoid(sums)[groups].detach() * adv * dsm).mean()


def official_loss(stage, track, prepared, cfg, weight, ref_weight, kl_weight=None, old_weight=None):
    """The official loss per drawn timestep (plus kl_beta mean (v - v_kl)^2), averaged over the
    draws as its gradient accumulation over timesteps does."""
    k = cfg.draws_per_sample
    s_all = prepared.conditions["dgpo/sigma"]
    eps_all = prepared.conditions["dgpo/noise"]
    x0, c = track.segment.final, track.conditions["c"]
    groups = torch.tensor([int(g[1:]) for g in track.group_ids])
    a = track.advantages.clamp(-cfg.adv_clip, cfg.adv_clip)
    losses = []
    for j in range(k):
        s, eps = s_all[:, j], eps_all[:, j]
        x_s = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps
        target = eps - x0
        v = velocity(stage, weight, x_s, s, c)
        with torch.no_grad():
            v_ref = velocity(stage, ref_weight, x_s, s, c)
            v_old = None if old_weight is None else velocity(stage, old_weight, x_s, s, c)
        loss = official_step_loss(v, v_ref, target, a, groups, 4, cfg.beta, v_old, cfg.clip_range)
        if cfg.kl_beta > 0:
            with torch.no_grad():
                v_kl = velocity(stage, kl_weight, x_s, s, c)
            loss = loss + cfg.kl_beta * (v - v_kl).square().reshape(len(v), -1).mean(dim=1).mean()
        losses.append(loss)
    return torch.stack(losses).mean()


@pytest.mark.parametrize("draws", [1, 3])
@pytest.mark.parametrize("reference", ["frozen", "ema"])
@pytest.mark.parametrize("kl_beta", [0.0, 0.3])
def test_loss_and_gradient_match_the_official_loss(reference, kl_beta, draws):
    stage = LinearStage()
    track = track8(stage)
    cfg = DGPOConfig(
        beta=7.0,
        reference=reference,
        kl_beta=kl_beta,
        draws_per_sample=draws,
        adv_clip=1.6,
        timestep_range=(0.0, 1.0),
    )
    algo = DGPO(cfg)
    frozen = stage.module.weight.detach().clone()
    prepared = algo.prepare_segment(stage, track)
    perturb(stage, 0.2)
    ema = (0.5 * frozen + 0.5 * stage.module.weight).detach()  # an EMA between the two
    perturb(stage, 0.1, seed=5)
    weight = stage.module.weight.detach().clone()
    ctx = {
        "loss_scale": 1.0,
        "reference": lambda: stage.swapped(frozen),
        "snapshots": {EMA_REFERENCE: lambda: stage.swapped(ema)},
    }
    stage.module.zero_grad()
    out = algo.compute_loss_and_backward(stage, prepared, ctx)
    w = weight.clone().requires_grad_(True)
    ref = frozen if reference == "frozen" else ema
    want = official_loss(stage, track, prepared, cfg, w, ref, kl_weight=frozen)
    want.backward()
    assert out["loss"] == pytest.approx(float(want.detach()), rel=1e-5)
    assert out["dgpo/group_sum_abs"] > 0.1  # off the reference: the sigmoid weights are not all 1/2
    assert_relative([stage.module.weight.grad], [w.grad], 1e-5)
    assert stage.module.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("draws", [1, 2])
def test_clip_stops_the_gradient_of_rows_moved_past_the_range(draws):
    """The official clip, against the sampling weights: clipped rows carry no gradient, kept
    rows train on A l (no ratio factor); the batch holds both kinds."""
    stage = LinearStage()
    track = track8(stage)
    cfg = DGPOConfig(beta=5.0, clip_range=0.01, draws_per_sample=draws, timestep_range=(0.0, 1.0))
    algo = DGPO(cfg)
    frozen = stage.module.weight.detach().clone()
    prepared = algo.prepare_segment(stage, track)
    with torch.no_grad():  # the weight only: the bias stays the sampling one
        stage.module.weight.add_(0.03 * torch.randn(frozen.shape, generator=torch.Generator().manual_seed(3)))
    weight = stage.module.weight.detach().clone()
    stage.module.zero_grad()
    out = algo.compute_loss_and_backward(
        stage, prepared, {"loss_scale": 1.0, "reference": lambda: stage.swapped(frozen)}
    )
    assert 0 < out["clipfrac"] < 1
    w = weight.clone().requires_grad_(True)
    want = official_loss(stage, track, prepared, cfg, w, frozen, old_weight=frozen)
    want.backward()
    assert out["loss"] == pytest.approx(float(want.detach()), rel=1e-5)
    assert_relative([stage.module.weight.grad], [w.grad], 1e-5)
    # without the clip the gradient differs: the clipped rows are in the batch
    stage.module.zero_grad()
    unclipped = DGPO(dataclasses.replace(cfg, clip_range=None))
    unclipped.compute_loss_and_backward(
        stage, prepared, {"loss_scale": 1.0, "reference": lambda: stage.swapped(frozen)}
    )
    assert not torch.allclose(stage.module.weight.grad, w.grad, rtol=1e-3)


def test_first_update_against_the_frozen_reference_is_advantage_weighted_matching():
    """At the reference (LoRA's start) every S_G = 0, every weight sigmoid(0) = 1/2: the gradient
    is 1/2 mean_i A_i grad l_i, whatever beta."""
    stage = LinearStage()
    track = track8(stage)
    algo = DGPO(DGPOConfig(beta=4.0, timestep_range=(0.0, 1.0)))
    prepared = algo.prepare_segment(stage, track)
    frozen = stage.module.weight.detach().clone()
    stage.module.zero_grad()
    out = algo.compute_loss_and_backward(
        stage, prepared, {"loss_scale": 1.0, "reference": lambda: stage.swapped(frozen)}
    )
    assert out["dgpo/group_sum_abs"] == 0.0 and out["dgpo/group_weight"] == 0.5
    assert out["dgpo/group_loss"] == pytest.approx(float(torch.log(torch.tensor(2.0))))
    s = prepared.conditions["dgpo/sigma"][:, 0]
    eps = prepared.conditions["dgpo/noise"][:, 0]
    x0 = track.segment.final
    x_s = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps
    w = frozen.clone().requires_grad_(True)
    err = ((velocity(stage, w, x_s, s, track.conditions["c"]) - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
    (0.5 * (ADV * err).mean()).backward()
    assert_relative([stage.module.weight.grad], [w.grad], 1e-5)


def test_group_scores_are_the_same_on_one_and_two_workers(monkeypatch):
    """Each worker holds whole groups of the data-parallel split, so its group scores are the
    single worker's, and the gradients averaged over the two workers are the single worker's."""
    sums = []
    real = dgpo_module.group_scores
    monkeypatch.setattr(dgpo_module, "group_scores", lambda *a: sums.append(real(*a)) or sums[-1])

    def train(tracks, stage, frozen):
        stage.module.zero_grad()
        algo = DGPO(DGPOConfig(beta=9.0, draws_per_sample=2, timestep_range=(0.0, 1.0)))
        for t in tracks:
            ctx = {"loss_scale": 1.0 / len(tracks), "reference": lambda: stage.swapped(frozen)}
            algo.compute_loss_and_backward(stage, algo.prepare_segment(stage, t), ctx)
        return stage.module.weight.grad.clone()

    stage = LinearStage()
    track = track8(stage)
    frozen = stage.module.weight.detach().clone()
    perturb(stage, 0.2)
    one = train([track], stage, frozen)
    ranks = split_for_ranks(track, 2)
    assert [t.group_ids for t in ranks] == [["g0"] * 4, ["g1"] * 4]
    two = train(ranks, stage, frozen)
    torch.testing.assert_close(sums[0], torch.cat(sums[1:]), rtol=1e-5, atol=0)  # batch-size kernels
    assert sums[0].abs().min() > 0
    torch.testing.assert_close(one, two, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        ({"beta": 0.0}, "algorithm.config.beta"),
        ({"reference": "old"}, "algorithm.config.reference"),
        ({"ema_decay": (0, 0.0, 1e-3, 1.5)}, "algorithm.config.ema_decay"),
        ({"clip_range": 2.0}, "algorithm.config.clip_range"),
        ({"kl_beta": -1.0}, "algorithm.config.kl_beta"),
        ({"kl_space": "logits"}, "algorithm.config.kl_space"),
        ({"train_guidance_scale": -1.0}, "algorithm.config.train_guidance_scale"),
    ],
)
def test_bad_config_names_the_key(kwargs, needle):
    with pytest.raises(ValueError, match=needle):
        DGPOConfig(**kwargs)


def test_guided_loss_needs_a_guided_rollout():
    from unirl.types import DiffusionSamplingParams

    algo = DGPO(DGPOConfig(kl_beta=1e-3, kl_guidance_scale=4.5, timestep_range=(0.0, 1.0)))
    algo.check_sampling(DiffusionSamplingParams(num_steps=10, guidance_scale=4.5))
    with pytest.raises(ValueError, match="algorithm.config.kl_guidance_scale=4.5"):
        algo.check_sampling(DiffusionSamplingParams(num_steps=10, guidance_scale=1.0))
