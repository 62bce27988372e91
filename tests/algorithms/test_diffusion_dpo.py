"""Diffusion-DPO: pair construction from group rewards, the loss and its gradient against a
direct computation of the formula, the first update against the reference (no Ray)."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

from tests.algorithms.test_step_losses import grads, perturb
from tests.conftest import tiny_model_config
from unirl.algorithms.advantages import track_advantages
from unirl.algorithms.diffusion_dpo import (
    DiffusionDPO,
    DiffusionDPOConfig,
    diffusion_dpo_loss,
    preference_pairs,
)
from unirl.models.sd3 import SD3Stage
from unirl.rollout.trainside import TrainsideEngine
from unirl.sde.schedules import sigmas_for
from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend
from unirl.train.stack import TrainStack, TrainStackConfig
from unirl.types import AdvantageConfig, DiffusionSamplingParams, PromptExample, RolloutReq


def setup(config: DiffusionDPOConfig, lora: bool = True, micro: int = 8, updates: int = 1):
    algo = DiffusionDPO(config)
    stage = SD3Stage(tiny_model_config().build())
    backend = TrainBackend(
        stage.module,
        LoRAConfig(rank=4, alpha=8) if lora else None,
        OptimConfig(lr=1e-2, weight_decay=0.0),
        10,
        keep_reference=algo.needs_reference_policy,
    )
    stage.module = backend.module
    stack = TrainStack(
        stage, backend, algo, TrainStackConfig(micro_batch_size=micro, num_updates_per_batch=updates)
    )
    sp = DiffusionSamplingParams(
        num_steps=4,
        samples_per_prompt=4,
        height=16,
        width=16,
        guidance_scale=2.0,
        eta=0.0,
        max_sequence_length=8,
    )
    sigmas = sigmas_for(sp, stage.bundle.image_seq_len(sp.height, sp.width))
    req = RolloutReq.from_prompts(
        [PromptExample("a red square", "0"), PromptExample("a blue dot", "1")], sp, sigmas, 0
    )
    track = TrainsideEngine(stage, forward_batch_size=8).generate(req).track("diffusion")
    track.rewards = track.media.float().mean(dim=(1, 2, 3))
    track_advantages(track, AdvantageConfig())
    return algo, stage, backend, stack, track


def ctx_of(backend) -> dict:
    return {"loss_scale": 1.0, "progress": 0.0, "reference": backend.reference}


def test_pairs_are_best_vs_worst_per_group_with_ties_and_equal_groups():
    rewards = torch.tensor([0.1, 0.5, 0.5, 0.2, 0.3, 0.3, 0.3, 0.3, 0.9, 0.0, 0.0])
    groups = ["a"] * 4 + ["b"] * 4 + ["c"] * 3
    chosen, rejected, skipped = preference_pairs(rewards, groups)
    # a: best 0.5 first at 1, worst 0.1 at 0; b: all equal -> skipped; c: best 8, worst first 0.0 at 9
    assert (chosen, rejected, skipped) == ([1, 8], [0, 9], 1)
    # groups need not be contiguous: order of first appearance
    assert preference_pairs(torch.tensor([1.0, 0.0, 2.0, 3.0]), ["x", "y", "x", "y"]) == ([2, 3], [0, 1], 0)


def test_a_group_of_one_is_a_clear_error():
    with pytest.raises(ValueError, match=r"group 'solo' has 1 sample .*samples_per_prompt >= 2"):
        preference_pairs(torch.tensor([0.1, 0.2, 0.3]), ["g", "g", "solo"])


def test_loss_against_the_direct_formula():
    err_w, err_l = torch.tensor([0.5, 0.2]), torch.tensor([0.4, 0.2])
    ref_w, ref_l = torch.tensor([0.45, 0.3]), torch.tensor([0.4, 0.1])
    loss, inside = diffusion_dpo_loss(err_w, err_l, ref_w, ref_l, beta=10.0)
    # pair 0: -5 * ((0.05) - (0.0)) = -0.25 ; pair 1: -5 * ((-0.1) - (0.1)) = 1.0
    torch.testing.assert_close(inside, torch.tensor([-0.25, 1.0]))
    torch.testing.assert_close(loss, torch.tensor([math.log1p(math.exp(0.25)), math.log1p(math.exp(-1.0))]))


def test_first_update_against_the_reference_is_log_two():
    algo, stage, backend, _, track = setup(DiffusionDPOConfig(beta=100.0))
    backend.zero_grad()
    metrics = algo.compute_loss_and_backward(stage, track, ctx_of(backend))
    # LoRA is the identity: policy == reference, inside = 0 for every pair
    assert metrics["loss"] == pytest.approx(math.log(2.0), abs=1e-7)
    assert metrics["dpo/margin"] == 0.0 and metrics["dpo/pairs"] == 2.0
    assert any(float(g.abs().sum()) > 0 for g in grads(backend))  # sigmoid'(0) = 1/2: still a gradient


def test_loss_and_gradient_match_the_formula():
    algo, stage, backend, _, track = setup(DiffusionDPOConfig(beta=50.0, draws_per_pair=2, seed=3))
    perturb(backend, scale=0.05)
    backend.zero_grad()
    metrics = algo.compute_loss_and_backward(stage, track, ctx_of(backend))
    got = grads(backend)

    backend.zero_grad()
    chosen, rejected, _ = preference_pairs(track.rewards, track.group_ids)
    sigma, noise = algo.draws(track, chosen)
    x0 = track.segment.final.float()

    def err(i, t, eps, reference):
        x_t = ((1 - t) * x0[i] + t * eps)[None]
        cond = {key: v[i : i + 1] for key, v in track.conditions.items()}
        with torch.no_grad() if reference else contextlib.nullcontext():
            with backend.reference() if reference else contextlib.nullcontext():
                v = stage.velocity(x_t, t[None], cond, 1.0)
        return ((v - (eps - x0[i])) ** 2).mean()

    terms = []
    for p, (w, lo) in enumerate(zip(chosen, rejected, strict=True)):
        for d in range(2):
            t, eps = sigma[p, d], noise[p, d]
            dw = err(w, t, eps, False) - err(w, t, eps, True)
            dl = err(lo, t, eps, False) - err(lo, t, eps, True)
            terms.append(-torch.log(torch.sigmoid(-25.0 * (dw - dl))))
    loss = torch.stack(terms).mean()
    loss.backward()
    for g, want in zip(got, grads(backend), strict=True):  # fp32 batching noise, relative to the gradient
        torch.testing.assert_close(g, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))
    assert metrics["loss"] == pytest.approx(float(loss.detach()), rel=1e-5)


def test_tied_groups_train_nothing_but_still_backpropagate():
    algo, stage, backend, _, track = setup(DiffusionDPOConfig())
    track.rewards = torch.ones(len(track))
    backend.zero_grad()
    metrics = algo.compute_loss_and_backward(stage, track, ctx_of(backend))
    assert metrics["dpo/pairs"] == 0.0 and metrics["dpo/tied_groups"] == 2.0 and metrics["loss"] == 0.0
    assert all(float(g.abs().sum()) == 0.0 for g in grads(backend))


def test_updates_raise_the_implicit_preference():
    """Several updates on one rollout: the chosen sample's error falls relative to the rejected
    one's (against the reference), so the loss drops below log 2."""
    algo, _, _, stack, track = setup(DiffusionDPOConfig(beta=2000.0), micro=4, updates=4)
    metrics = stack.train_track(track, progress=0.0)
    micro, ctx = stack.prepare(track, progress=0.0)
    after = stack.backward(micro, ctx)
    assert metrics["train/skipped_step"] == 0
    assert sum(r["loss"] for r in after) / len(after) < math.log(2.0)
    assert all(r["dpo/implicit_acc"] == 1.0 for r in after)


def test_needs_rewards_and_a_positive_beta():
    algo, stage, backend, _, track = setup(DiffusionDPOConfig())
    track.rewards = None
    with pytest.raises(ValueError, match="has no rewards"):
        algo.compute_loss_and_backward(stage, track, ctx_of(backend))
    with pytest.raises(ValueError, match="beta must be > 0"):
        DiffusionDPOConfig(beta=0.0)


@pytest.mark.parametrize(
    ("name", "overrides", "expected"),
    [
        (
            "diffusion/tiny_sd3_diffusiondpo",
            ["sampling.samples_per_prompt=1", "train.stack.micro_batch_size=4"],
            "sampling.samples_per_prompt=1: DiffusionDPO compares the samples of a prompt group",
        ),
        (
            "diffusion/tiny_sd3_diffusiondpo",
            ["train.stack.micro_batch_size=4"],
            "train.stack.micro_batch_size=4: DiffusionDPO compares the samples of a prompt group, so each "
            "micro-batch must hold whole groups; set it to a multiple of sampling.samples_per_prompt=8",
        ),
        ("diffusion/tiny_sd3_dpok", ["algorithm.config.beta=0.0"], "beta must be > 0 for DPOK"),
        (
            "diffusion/tiny_sd3_dpok",
            ["algorithm.config.kl_target=-1.0"],
            "algorithm.config.kl_target must be > 0 or null",
        ),
        ("diffusion/tiny_sd3_flowdppo", ["sampling.eta=0.0"], "FlowDPPO needs step log-probs"),
    ],
)
def test_bad_recipes_are_refused_before_ray(name, overrides, expected):
    from tests.config.test_validate import problems_of

    assert expected in problems_of(overrides, name)
