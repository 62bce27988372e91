"""DGPO's loss and gradient against the group preference loss written out here (frozen and EMA
references, the KL, the clip), its group sums on one worker and on two (the track split as the
data-parallel scatter splits it), and its config errors (no Ray; a stand-in linear denoiser,
`tests/algorithms/linear_stage.py`)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

import unirl.algorithms.dgpo as dgpo_module
from tests.algorithms.linear_stage import LinearStage, perturb, sampled_track
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


def hand_loss(stage, track, prepared, cfg, weight, ref_weight, kl_weight=None):
    """-mean_G log sigmoid(-beta sum_i A_i (l_i - l_ref,i)) + kl_beta mean (v - v_kl)^2."""
    k = cfg.draws_per_sample
    s = prepared.conditions["dgpo/sigma"].reshape(-1)
    eps = prepared.conditions["dgpo/noise"].flatten(0, 1)
    x0 = track.segment.final.repeat_interleave(k, dim=0)
    x_s = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps
    c = track.conditions["c"].repeat_interleave(k)
    target = eps - x0
    v = velocity(stage, weight, x_s, s, c)
    with torch.no_grad():
        v_ref = velocity(stage, ref_weight, x_s, s, c)
    err = ((v - target) ** 2).mean(dim=(1, 2, 3)).view(-1, k).mean(1)
    err_ref = ((v_ref - target) ** 2).mean(dim=(1, 2, 3)).view(-1, k).mean(1)
    a = track.advantages.clamp(-cfg.adv_clip, cfg.adv_clip)
    terms = []
    for g in sorted(set(track.group_ids)):
        m = torch.tensor([gid == g for gid in track.group_ids])
        terms.append(-F.logsigmoid(-cfg.beta * (a[m] * (err[m] - err_ref[m])).sum()))
    loss = torch.stack(terms).mean()
    if cfg.kl_beta > 0:
        with torch.no_grad():
            v_kl = velocity(stage, kl_weight, x_s, s, c)
        loss = loss + cfg.kl_beta * ((v - v_kl) ** 2).mean()
    return loss


@pytest.mark.parametrize("reference", ["frozen", "ema"])
@pytest.mark.parametrize("kl_beta", [0.0, 0.3])
def test_loss_and_gradient_match_the_group_preference_loss(reference, kl_beta):
    stage = LinearStage()
    track = track8(stage)
    cfg = DGPOConfig(
        beta=7.0,
        reference=reference,
        kl_beta=kl_beta,
        draws_per_sample=2,
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
    want = hand_loss(stage, track, prepared, cfg, w, ref, kl_weight=frozen)
    want.backward()
    assert out["loss"] == pytest.approx(float(want.detach()), rel=1e-5)
    torch.testing.assert_close(stage.module.weight.grad, w.grad, rtol=1e-4, atol=1e-7)
    assert stage.module.weight.grad.abs().sum() > 0


def test_clip_masks_samples_moved_past_the_range():
    """With the clip, sum_G sg(c_G) sum_i max(-A r, -A clip(r)) / G: its gradient written out."""
    stage = LinearStage()
    track = track8(stage)
    cfg = DGPOConfig(beta=5.0, clip_range=0.01, timestep_range=(0.0, 1.0))
    algo = DGPO(cfg)
    frozen = stage.module.weight.detach().clone()
    prepared = algo.prepare_segment(stage, track)
    l_old = prepared.conditions["dgpo/l_old"].clone()
    perturb(stage, 0.3)
    weight = stage.module.weight.detach().clone()
    stage.module.zero_grad()
    out = algo.compute_loss_and_backward(
        stage, prepared, {"loss_scale": 1.0, "reference": lambda: stage.swapped(frozen)}
    )
    s = prepared.conditions["dgpo/sigma"].reshape(-1)
    eps = prepared.conditions["dgpo/noise"].flatten(0, 1)
    x0 = track.segment.final
    x_s = (1 - s.view(-1, 1, 1, 1)) * x0 + s.view(-1, 1, 1, 1) * eps
    c = track.conditions["c"]
    w = weight.clone().requires_grad_(True)
    err = ((velocity(stage, w, x_s, s, c) - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
    err_ref = ((velocity(stage, frozen, x_s, s, c) - (eps - x0)) ** 2).mean(dim=(1, 2, 3))
    a = track.advantages
    r = torch.exp(l_old - err)
    per = torch.maximum(-a * r, -a * r.clamp(0.99, 1.01))
    total = 0
    for g in range(2):
        m = slice(4 * g, 4 * g + 4)
        sg = (a[m] * (err[m] - err_ref[m])).sum().detach()
        total = total + 5.0 * torch.sigmoid(5.0 * sg) * per[m].sum()
    (total / 2).backward()
    torch.testing.assert_close(stage.module.weight.grad, w.grad, rtol=1e-4, atol=1e-7)
    assert 0 < out["clipfrac"] <= 1


def test_first_update_against_the_frozen_reference_is_advantage_weighted_matching():
    """At the reference (LoRA's start) every S_G = 0: the gradient is beta/2 mean_G sum_i A_i grad l_i."""
    stage = LinearStage()
    track = track8(stage)
    algo = DGPO(DGPOConfig(beta=4.0, timestep_range=(0.0, 1.0)))
    prepared = algo.prepare_segment(stage, track)
    frozen = stage.module.weight.detach().clone()
    out = algo.compute_loss_and_backward(
        stage, prepared, {"loss_scale": 1.0, "reference": lambda: stage.swapped(frozen)}
    )
    assert out["dgpo/group_sum_abs"] == 0.0 and out["loss"] == pytest.approx(
        float(torch.log(torch.tensor(2.0)))
    )
    assert out["dgpo/group_weight"] == pytest.approx(2.0)


def test_group_sums_are_the_same_on_one_and_two_workers(monkeypatch):
    """Each worker holds whole groups of the data-parallel split, so its group sums are the
    single worker's, and the gradients averaged over the two workers are the single worker's."""
    sums = []
    real = dgpo_module.group_sums
    monkeypatch.setattr(dgpo_module, "group_sums", lambda *a: sums.append(real(*a)) or sums[-1])

    def train(tracks, stage, frozen):
        stage.module.zero_grad()
        algo = DGPO(DGPOConfig(beta=9.0, timestep_range=(0.0, 1.0)))
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
    torch.testing.assert_close(sums[0], torch.cat(sums[1:]), rtol=0, atol=0)
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
