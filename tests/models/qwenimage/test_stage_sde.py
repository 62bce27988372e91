"""One SDE step of Qwen-Image through the shared stage, under true CFG: its recorded log-prob is the
Gaussian log-density of the stored next latent, computed here independently (the transformer
called with QwenImagePipeline's packing and `encode_prompt` embeddings, the norm-rescaled true CFG
written out, Flow-GRPO's SDE formulas, fp64 `torch.distributions.Normal`)."""

from __future__ import annotations

import math

import torch
from diffusers import QwenImagePipeline

from unirl.models.qwenimage import QwenImageStage
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

TOL = 1e-5  # fp32 stage vs fp64 reference, log-densities of order 1


def test_sde_log_prob_is_the_gaussian_density_of_the_stored_step(qwen_bundle) -> None:
    eta, step, size, scale, prompt, negative = 0.7, 1, 16, 4.0, "a red square", "a blue square"
    qwen_bundle.negative_prompt = negative  # as long as the prompt: no padding on either side
    sp = DiffusionSamplingParams(
        num_steps=3,
        samples_per_prompt=2,
        height=size,
        width=size,
        guidance_scale=scale,
        eta=eta,
        dynamic_shift=True,
        max_seq_len=8192,
        max_shift=0.9,
        sigma_grid="steps",
        max_sequence_length=8,
        sde_scheduler="fixed",
        sde_steps=[step],
    )
    stage = QwenImageStage(qwen_bundle)
    sigmas = sigmas_for(sp, qwen_bundle.image_seq_len(size, size))
    req = RolloutReq.from_prompts([PromptExample(prompt, "0")], sp, sigmas, 0)
    cond = stage.encode_prompts(req.prompts, scale, sp.max_sequence_length)
    seg = stage.diffuse(req, cond)
    x, x_next = seg.at(step), seg.at(step + 1)

    # the velocity: both branches through the transformer, combined as QwenImagePipeline does
    b, c, h, w = x.shape
    pipe = qwen_bundle.pipeline

    def branch(text: str) -> torch.Tensor:
        embeds, mask = pipe.encode_prompt([text] * b, max_sequence_length=8)
        return qwen_bundle.transformer(
            hidden_states=QwenImagePipeline._pack_latents(x, b, c, h, w),
            timestep=sigmas[step].expand(b) * 1000 / 1000,
            encoder_hidden_states=embeds,
            encoder_hidden_states_mask=mask,
            img_shapes=[[(1, h // 2, w // 2)]] * b,
            return_dict=False,
        )[0]

    with torch.no_grad():
        v_c, v_u = branch(prompt), branch(negative)
    comb = v_u + scale * (v_c - v_u)
    packed_v = comb * (torch.norm(v_c, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    v = QwenImagePipeline._unpack_latents(packed_v, size, size, qwen_bundle.vae_scale_factor)[
        :, :, 0
    ].double()

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
