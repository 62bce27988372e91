"""ODE sampling through `SD3Stage` equals diffusers' `StableDiffusion3Pipeline`.

A tiny latent-space SD3 (tiny transformer, tiny VAE, two tiny CLIPs and a T5,
built from configs offline) samples the same prompts from the same x_T with
eta 0 through our stage and through the pipeline (`output_type="latent"`, the
pipeline's own prompt encoding, CFG and scheduler). Both run the same fp32
ops on the same inputs, so the final latents agree to TOL.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

from tests.conftest import tiny_model_config
from unirl.models.sd3 import SD3Stage
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

TOL = 1e-5  # max abs difference of final latents (values of order 1)
PROMPTS = ["a red square", "a blue dot"]


@pytest.fixture(scope="module")
def bundle():
    return tiny_model_config(pixel_space=False).build()


def stage_sample(
    stage: SD3Stage, sp: DiffusionSamplingParams
) -> tuple[torch.Tensor, torch.Tensor, RolloutReq]:
    """(x_T [B, C, h, w], final latents [B, C, h, w], request) of an eta-0 rollout."""
    sigmas = sigmas_for(sp, stage.bundle.image_seq_len(sp.height, sp.width))
    req = RolloutReq.from_prompts([PromptExample(p, str(i)) for i, p in enumerate(PROMPTS)], sp, sigmas, 0)
    assert req.sde_indices == []
    cond = stage.encode_prompts(req.prompts, sp.guidance_scale, sp.max_sequence_length)
    seg = stage.diffuse(req, cond)
    shape = stage.bundle.latent_shape(sp.height, sp.width)
    x_t = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in req.init_seeds]
    )
    assert seg.positions == [sp.num_steps]
    return x_t, seg.at(sp.num_steps), req


def pipeline_sample(
    bundle, scheduler: FlowMatchEulerDiscreteScheduler, sp: DiffusionSamplingParams, x_t: torch.Tensor
) -> torch.Tensor:
    pipe = StableDiffusion3Pipeline(**{**bundle.pipeline.components, "scheduler": scheduler})
    pipe.set_progress_bar_config(disable=True)
    k = sp.samples_per_prompt
    with torch.no_grad():
        return pipe(
            prompt=PROMPTS,
            num_images_per_prompt=k,
            height=sp.height,
            width=sp.width,
            num_inference_steps=sp.num_steps,
            guidance_scale=sp.guidance_scale,
            latents=x_t,
            max_sequence_length=sp.max_sequence_length,
            output_type="latent",
        ).images


@pytest.mark.parametrize(
    ("num_steps", "guidance", "dynamic"),
    [(10, 3.0, False), (4, 1.0, False), (6, 4.5, True)],
)
def test_ode_sampling_matches_diffusers_pipeline(
    bundle, num_steps: int, guidance: float, dynamic: bool
) -> None:
    sp = DiffusionSamplingParams(
        num_steps=num_steps,
        samples_per_prompt=2,
        height=16,
        width=16,
        guidance_scale=guidance,
        eta=0.0,
        shift=3.0,
        dynamic_shift=dynamic,
        max_sequence_length=8,
    )
    x_t, ours, _ = stage_sample(SD3Stage(bundle), sp)
    scheduler = (
        FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
        if dynamic
        else FlowMatchEulerDiscreteScheduler(shift=sp.shift)
    )
    theirs = pipeline_sample(bundle, scheduler, sp, x_t)
    assert ours.shape == theirs.shape == x_t.shape
    err = (ours - theirs).abs().max().item()
    assert err <= TOL, f"max |stage - pipeline| = {err}"
    assert (ours - x_t).abs().max().item() > 0.1  # it did denoise something


def test_old_linspace_schedule_would_not_match(bundle) -> None:
    """The parity above is a real check: the schedule linspace(1, 0, T+1) of
    earlier versions ends 0.25 -> 0 and lands measurably elsewhere."""
    sp = DiffusionSamplingParams(
        num_steps=10,
        samples_per_prompt=1,
        height=16,
        width=16,
        guidance_scale=3.0,
        eta=0.0,
        max_sequence_length=8,
    )
    stage = SD3Stage(bundle)
    x_t, ours, req = stage_sample(stage, sp)
    t = torch.linspace(1.0, 0.0, 11)
    old = RolloutReq(**{**vars(req), "sigmas": (3 * t / (1 + 2 * t)).float()})
    cond = stage.encode_prompts(req.prompts, sp.guidance_scale, sp.max_sequence_length)
    assert (stage.diffuse(old, cond).at(10) - ours).abs().max().item() > 100 * TOL
