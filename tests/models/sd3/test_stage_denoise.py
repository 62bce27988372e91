"""The stage's differentiable path (reward backprop): stored trajectories, `denoise`, `decode_float`."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model_config
from unirl.models.sd3 import SD3Stage
from unirl.models.stage import DifferentiableDiffusionStage
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq


def _rollout(stage: SD3Stage, guidance: float = 2.0, steps: int = 4):
    sp = DiffusionSamplingParams(
        num_steps=steps,
        samples_per_prompt=2,
        height=16,
        width=16,
        guidance_scale=guidance,
        eta=0.0,
        shift=1.0,
        max_sequence_length=8,
    )
    sigmas = sigmas_for(sp, stage.bundle.image_seq_len(16, 16))
    req = RolloutReq.from_prompts(
        [PromptExample("a red square", "0"), PromptExample("a blue circle", "1")], sp, sigmas, 3
    )
    cond = stage.encode_prompts(req.prompts, sp.guidance_scale, sp.max_sequence_length)
    return req, cond, stage.diffuse(req, cond)


@pytest.fixture
def vae_bundle():
    return tiny_model_config(pixel_space=False, resolution=16, patch_size=2).build()


def test_sd3_stage_is_differentiable(tiny_bundle):
    assert isinstance(SD3Stage(tiny_bundle), DifferentiableDiffusionStage)


def test_store_trajectory_keeps_every_position_and_the_same_samples(tiny_bundle):
    _, _, plain = _rollout(SD3Stage(tiny_bundle))
    _, _, full = _rollout(SD3Stage(tiny_bundle, store_trajectory=True))
    assert plain.positions == [4] and full.positions == [0, 1, 2, 3, 4]
    assert torch.equal(plain.final, full.final)


@pytest.mark.parametrize("guidance", [1.0, 2.0])
def test_denoise_from_a_stored_position_reproduces_the_rollout_exactly(tiny_bundle, guidance):
    stage = SD3Stage(tiny_bundle, store_trajectory=True, detach_uncond=False)
    req, cond, seg = _rollout(stage, guidance)
    for start in range(4):
        with torch.no_grad():
            x = stage.denoise(seg.at(start), seg.sigmas, cond, guidance, range(start, 4))
        assert torch.equal(x, seg.final), start
    with torch.no_grad():
        mid = stage.denoise(seg.at(1), seg.sigmas, cond, guidance, range(1, 3))
    assert torch.equal(mid, seg.at(3))


def test_denoise_keeps_the_graph_and_checkpointing_gives_the_same_gradient(tiny_bundle):
    stage = SD3Stage(tiny_bundle, store_trajectory=True, detach_uncond=False)
    _, cond, seg = _rollout(stage)
    params = [p for p in stage.module.parameters() if p.requires_grad]
    grads = []
    for checkpoint in (False, True):
        x = stage.denoise(seg.at(1), seg.sigmas, cond, 2.0, range(1, 4), checkpoint=checkpoint)
        assert torch.equal(x.detach(), seg.final)
        loss = (stage.decode_float(x) ** 2).mean()
        grads.append(torch.autograd.grad(loss, params))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
    assert any(g.abs().sum() > 0 for g in grads[0])


def test_denoise_gradient_matches_finite_differences_in_the_input(tiny_bundle):
    """d sum(w * x_T) / d x_start against central differences: the chain through three
    Euler steps and the guided velocity, written nowhere else."""
    stage = SD3Stage(tiny_bundle, store_trajectory=True, detach_uncond=False)
    _, cond, seg = _rollout(stage)
    x0 = seg.at(1).clone().requires_grad_(True)
    w = torch.randn(seg.final.shape, generator=torch.Generator().manual_seed(0))

    def f(x):
        return (w * stage.denoise(x, seg.sigmas, cond, 2.0, range(1, 4))).sum()

    (grad,) = torch.autograd.grad(f(x0), x0)
    d = torch.randn(x0.shape, generator=torch.Generator().manual_seed(1))
    h = 1e-2
    with torch.no_grad():
        fd = (f(x0 + h * d) - f(x0 - h * d)) / (2 * h)
    torch.testing.assert_close((grad * d).sum(), fd, rtol=2e-2, atol=1e-3)


@pytest.mark.parametrize("pixel_space", [True, False])
def test_decode_is_decode_float_rounded(tiny_bundle, vae_bundle, pixel_space):
    stage = SD3Stage(tiny_bundle if pixel_space else vae_bundle)
    shape = stage.bundle.latent_shape(16, 16)
    latents = 1.3 * torch.randn((3, *shape), generator=torch.Generator().manual_seed(0))
    f = stage.decode_float(latents)
    assert f.shape == (3, 3, 16, 16) and f.dtype == torch.float32 and 0 <= f.min() and f.max() <= 1
    u8 = stage.decode(latents)
    assert (u8.int() - (f * 255).round().int()).abs().max() <= 1  # equal up to float rounding
    assert (u8 == (f * 255).round().to(torch.uint8)).float().mean() > 0.99
    latents.requires_grad_(True)
    stage.decode_float(latents).sum().backward()
    assert latents.grad.abs().sum() > 0
