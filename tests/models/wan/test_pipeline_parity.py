"""ODE sampling through the shared stage equals diffusers' `WanPipeline` on a tiny Wan 2.1.

Same tiny weights (random transformer, tiny causal video VAE, UMT5 built offline), prompts, x_T
and sigma schedule: the pipeline computes its own schedule (the Euler scheduler's own grid shifted by 3.0),
its own prompt encoding (UMT5, zeros past each prompt, the empty negative prompt), classifier-free
guidance in two forwards and the VAE's latent de-normalization; our stage pins
`sigma_grid: scheduler` with `shift: 3.0`, runs the cond and uncond halves in one batched forward and
the same fp32 Euler arithmetic.
"""

from __future__ import annotations

import torch
from diffusers import WanPipeline

from unirl.models.wan import WanStage
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

PROMPTS = ["a red square", "a blue dot"]


def test_ode_sampling_matches_wan_pipeline(wan_bundle) -> None:
    num_steps, guidance, size = 4, 5.0, 16  # WanPipeline takes multiples of 16 px
    sp = DiffusionSamplingParams(
        num_steps=num_steps,
        samples_per_prompt=2,
        height=size,
        width=size,
        guidance_scale=guidance,
        eta=0.0,
        shift=3.0,
        max_sequence_length=8,
    )
    stage = WanStage(wan_bundle)
    sigmas = sigmas_for(sp, wan_bundle.image_seq_len(size, size))
    req = RolloutReq.from_prompts([PromptExample(p, str(i)) for i, p in enumerate(PROMPTS)], sp, sigmas, 0)
    cond = stage.encode_prompts(req.prompts, sp.guidance_scale, sp.max_sequence_length)
    assert set(cond) == {"prompt_embeds", "negative_prompt_embeds"}  # the uncond branch: ""
    seg = stage.diffuse(req, cond)
    ours = seg.at(num_steps)
    shape = wan_bundle.latent_shape(size, size)
    assert shape == (4, 3, size // 2, size // 2)  # 5 frames -> 1 + 4/2 latent frames
    x_t = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in req.init_seeds]
    )

    pipe = WanPipeline(**wan_bundle.pipeline.components)
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def keep_last(pipe, i, t, tensors):  # the latents after the last step, before decoding
        final["latents"] = tensors["latents"]
        return tensors

    with torch.no_grad():
        frames = pipe(
            prompt=PROMPTS,
            num_videos_per_prompt=sp.samples_per_prompt,
            height=size,
            width=size,
            num_frames=wan_bundle.num_frames,
            num_inference_steps=num_steps,
            guidance_scale=guidance,
            latents=x_t,
            max_sequence_length=sp.max_sequence_length,
            output_type="pt",
            callback_on_step_end=keep_last,
        ).frames
    theirs = final["latents"]
    assert torch.equal(pipe.scheduler.sigmas, sigmas)  # the pinned schedule is the pipeline's
    assert (ours - x_t).abs().max().item() > 0.1  # it did denoise something
    assert torch.equal(ours, theirs), f"max |stage - pipeline| = {(ours - theirs).abs().max().item()}"
    video = stage.decode_float(ours)
    assert video.shape == frames.shape == (4, wan_bundle.num_frames, 3, size, size)
    assert torch.equal(video, frames)


def test_guidance_runs_the_uncond_branch(wan_bundle) -> None:
    """CFG: the velocity at scale s is v_u + s (v_c - v_u) of the empty prompt's and the prompt's
    one-branch velocities."""
    stage = WanStage(wan_bundle)
    cond = stage.encode_prompts(["a red square"], 5.0, 8)
    x = torch.randn(1, *wan_bundle.latent_shape(8, 8), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.7])
    with torch.no_grad():
        guided = stage.velocity(x, sigma, cond, 5.0)
        v_c = stage.velocity(x, sigma, {"prompt_embeds": cond["prompt_embeds"]}, 1.0)
        v_u = stage.velocity(x, sigma, {"prompt_embeds": cond["negative_prompt_embeds"]}, 1.0)
    assert not torch.allclose(v_c, v_u)
    torch.testing.assert_close(guided, v_u + 5.0 * (v_c - v_u), rtol=0, atol=1e-5)
