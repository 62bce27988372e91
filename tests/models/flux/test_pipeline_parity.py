"""ODE sampling through the shared stage equals diffusers' `FluxPipeline` on a tiny FLUX.1.

Same tiny weights (random transformer with a guidance embedding, tiny VAE, CLIP and T5 built
offline), prompts, x_T and sigma schedule: the pipeline computes its own schedule
(`linspace(1, 1/T, T)`, mu from the packed token count), its own prompt encoding, packing,
image ids and embedded guidance; our stage pins `sigma_grid: steps` with `dynamic_shift` and
runs the same fp32 ops, so the final latents and the decoded images agree bit for bit.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FluxPipeline

from unirl.models.flux import FluxStage
from unirl.models.flux.bundle import pack, unpack
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

PROMPTS = ["a red square", "a blue dot"]


@pytest.mark.parametrize(("num_steps", "guidance", "size"), [(4, 3.5, 32), (2, 1.0, 16)])
def test_ode_sampling_matches_flux_pipeline(flux_bundle, num_steps: int, guidance: float, size: int) -> None:
    sp = DiffusionSamplingParams(
        num_steps=num_steps,
        samples_per_prompt=2,
        height=size,
        width=size,
        guidance_scale=guidance,
        eta=0.0,
        dynamic_shift=True,
        sigma_grid="steps",
        max_sequence_length=8,
    )
    stage = FluxStage(flux_bundle)
    sigmas = sigmas_for(sp, flux_bundle.image_seq_len(size, size))
    req = RolloutReq.from_prompts([PromptExample(p, str(i)) for i, p in enumerate(PROMPTS)], sp, sigmas, 0)
    cond = stage.encode_prompts(req.prompts, sp.guidance_scale, sp.max_sequence_length)
    assert set(cond) == {"prompt_embeds", "pooled_prompt_embeds"}  # no uncond branch
    seg = stage.diffuse(req, cond)
    ours = seg.at(num_steps)
    shape = flux_bundle.latent_shape(size, size)
    x_t = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in req.init_seeds]
    )

    pipe = FluxPipeline(**flux_bundle.pipeline.components)
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def keep_last(pipe, i, t, tensors):  # the packed latents after the last step, before decoding
        final["latents"] = tensors["latents"]
        return tensors

    with torch.no_grad():
        images = pipe(
            prompt=PROMPTS,
            num_images_per_prompt=sp.samples_per_prompt,
            height=size,
            width=size,
            num_inference_steps=num_steps,
            guidance_scale=guidance,
            latents=pack(x_t),
            max_sequence_length=sp.max_sequence_length,
            output_type="pt",
            callback_on_step_end=keep_last,
        ).images
    theirs = unpack(final["latents"], *shape[1:])
    assert torch.equal(pipe.scheduler.sigmas, sigmas)  # the pinned schedule is the pipeline's
    assert (ours - x_t).abs().max().item() > 0.1  # it did denoise something
    assert torch.equal(ours, theirs), f"max |stage - pipeline| = {(ours - theirs).abs().max().item()}"
    assert torch.equal(stage.decode_float(ours), images)


def test_guidance_is_a_network_input(flux_bundle) -> None:
    """Embedded guidance: a different scale changes the velocity through one forward."""
    stage = FluxStage(flux_bundle)
    cond = stage.encode_prompts(["a red square"], 3.5, 8)
    x = torch.randn(1, *flux_bundle.latent_shape(16, 16), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7])
    with torch.no_grad():
        v1, v35 = (stage.velocity(x, sigma, cond, s) for s in (1.0, 3.5))
    assert not torch.allclose(v1, v35)
