"""One SDE step of Wan through the shared stage: its recorded log-prob is the Gaussian log-density
of the stored next video latent, computed here independently (the transformer called directly
with WanPipeline's own prompt encoding and CFG, Flow-GRPO's SDE formulas, fp64
`torch.distributions.Normal` averaged over channels, frames, rows and columns)."""

from __future__ import annotations

import math

import torch

from unirl.models.wan import WanStage
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

TOL = 1e-5  # fp32 stage vs fp64 reference, log-densities of order 1


def test_sde_log_prob_is_the_gaussian_density_of_the_stored_step(wan_bundle) -> None:
    eta, step, size, guidance = 0.7, 1, 8, 4.0
    sp = DiffusionSamplingParams(
        num_steps=3,
        samples_per_prompt=2,
        height=size,
        width=size,
        guidance_scale=guidance,
        eta=eta,
        shift=3.0,
        max_sequence_length=8,
        sde_scheduler="fixed",
        sde_steps=[step],
    )
    stage = WanStage(wan_bundle)
    sigmas = sigmas_for(sp, wan_bundle.image_seq_len(size, size))
    req = RolloutReq.from_prompts([PromptExample("a red square", "0")], sp, sigmas, 0)
    cond = stage.encode_prompts(req.prompts, guidance, sp.max_sequence_length)
    seg = stage.diffuse(req, cond)
    x, x_next = seg.at(step), seg.at(step + 1)
    assert x.shape == (2, 4, 3, size // 2, size // 2)  # [B, C, f, h, w]

    b = x.shape[0]
    pe, neg = wan_bundle.pipeline.encode_prompt(["a red square"] * b, max_sequence_length=8)
    t = sigmas[step].expand(b) * 1000
    with torch.no_grad():
        v_c, v_u = (
            wan_bundle.transformer(hidden_states=x, timestep=t, encoder_hidden_states=e, return_dict=False)[0]
            for e in (pe, neg)
        )
    v = (v_u + guidance * (v_c - v_u)).double()

    sigma, sigma_next = float(sigmas[step]), float(sigmas[step + 1])
    dt = sigma_next - sigma
    std_dev_t = math.sqrt(sigma / (1 - sigma)) * eta
    mean = (
        x.double() * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    std = std_dev_t * math.sqrt(-dt)
    expected = torch.distributions.Normal(mean, std).log_prob(x_next.double()).mean(dim=(1, 2, 3, 4))

    assert seg.sde_indices == [step] and seg.log_probs.shape == (b, 1)
    err = (seg.log_probs[:, 0].double() - expected).abs().max().item()
    assert err <= TOL, f"max |stage - reference| = {err}"
    with torch.no_grad():
        replayed, _, _ = stage.replay(seg, cond, [step])
    assert torch.allclose(replayed, seg.log_probs, atol=1e-6, rtol=0)  # on-policy ratio 1
