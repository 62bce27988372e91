"""One SDE step of FLUX through the shared stage: its recorded log-prob is the Gaussian
log-density of the stored next latent, computed here independently (FluxPipeline's own packing
helpers for the network call, Flow-GRPO's SDE formulas, fp64 `torch.distributions.Normal`)."""

from __future__ import annotations

import math

import torch
from diffusers import FluxPipeline

from unirl.models.flux import FluxStage
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

TOL = 1e-5  # fp32 stage vs fp64 reference, log-densities of order 1


def test_sde_log_prob_is_the_gaussian_density_of_the_stored_step(flux_bundle) -> None:
    eta, step, size, guidance = 0.7, 1, 16, 3.5
    sp = DiffusionSamplingParams(
        num_steps=3,
        samples_per_prompt=2,
        height=size,
        width=size,
        guidance_scale=guidance,
        eta=eta,
        dynamic_shift=True,
        sigma_grid="steps",
        max_sequence_length=8,
        sde_scheduler="fixed",
        sde_steps=[step],
    )
    stage = FluxStage(flux_bundle)
    sigmas = sigmas_for(sp, flux_bundle.image_seq_len(size, size))
    req = RolloutReq.from_prompts([PromptExample("a red square", "0")], sp, sigmas, 0)
    cond = stage.encode_prompts(req.prompts, guidance, sp.max_sequence_length)
    seg = stage.diffuse(req, cond)
    x, x_next = seg.at(step), seg.at(step + 1)

    # the velocity, through the pipeline's packing and ids and the transformer's guidance input
    b, c, h, w = x.shape
    pe, pooled, text_ids = flux_bundle.pipeline.encode_prompt(["a red square"] * b, max_sequence_length=8)
    with torch.no_grad():
        out = flux_bundle.transformer(
            hidden_states=FluxPipeline._pack_latents(x, b, c, h, w),
            timestep=sigmas[step].expand(b) * 1000 / 1000,
            guidance=torch.full([b], guidance),
            pooled_projections=pooled,
            encoder_hidden_states=pe,
            txt_ids=text_ids,
            img_ids=FluxPipeline._prepare_latent_image_ids(b, h // 2, w // 2, "cpu", torch.float32),
            return_dict=False,
        )[0]
    v = FluxPipeline._unpack_latents(out, size, size, flux_bundle.vae_scale_factor).double()

    sigma, sigma_next = float(sigmas[step]), float(sigmas[step + 1])
    dt = sigma_next - sigma
    std_dev_t = math.sqrt(sigma / (1 - sigma)) * eta
    mean = (
        x.double() * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    std = std_dev_t * math.sqrt(-dt)
    expected = torch.distributions.Normal(mean, std).log_prob(x_next.double()).mean(dim=(1, 2, 3))

    assert seg.sde_indices == [step] and seg.log_probs.shape == (b, 1)
    err = (seg.log_probs[:, 0].double() - expected).abs().max().item()
    assert err <= TOL, f"max |stage - reference| = {err}"
    with torch.no_grad():
        replayed, _, _ = stage.replay(seg, cond, [step])
    assert torch.allclose(replayed, seg.log_probs, atol=1e-6, rtol=0)  # on-policy ratio 1
