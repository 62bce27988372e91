"""ODE sampling through the shared stage equals diffusers' `QwenImagePipeline` on a tiny Qwen-Image.

Same tiny weights (random transformer, tiny AutoencoderKLQwenImage, tiny Qwen2.5-VL encoder built
offline), prompts, x_T and sigma schedule: the pipeline computes its own schedule
(`linspace(1, 1/T, T)`, mu from the packed token count on its scheduler's line), its own prompt
encoding (chat template, 34 dropped tokens), packing, `img_shapes` and true CFG with norm
rescaling; our stage pins `sigma_grid: steps` with `dynamic_shift` on the same line.

Where our conditioning has the pipeline's lengths (every prompt, and the negative prompt, as long
as `max_sequence_length`) the final latents and images agree bit for bit. Where ours is padded
beyond the pipeline's (the stage pads every prompt to `max_sequence_length`, so prompts of
different lengths share a batch and a data-plane track; the pipeline pads to the batch's longest),
the padded keys are masked out of attention: their weight is exactly 0, but the attention kernel
reduces over a longer row, so fp32 rounding differs. `PADDED_ATOL` bounds that.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, QwenImagePipeline

from unirl.models.qwenimage import QwenImageStage
from unirl.models.qwenimage.bundle import pack, unpack
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

PROMPTS = ["a red square", "a blue dot"]  # 8 tokens each after the template prefix
PADDED_ATOL = 1e-5  # measured 1e-6 on latents of magnitude ~2 (4 steps)


def sample_both(
    bundle,
    negative: str,
    guidance: float,
    max_len: int,
    shift_terminal: float | None = None,
    num_steps: int = 3,
):
    """(ours, theirs, x_T, our images, their images, our sigmas, their sigmas); with `shift_terminal`
    the pipeline's scheduler stretches its schedule to it (Qwen-Image's scheduler: 0.02)."""
    size = 16
    bundle.negative_prompt = negative
    sp = DiffusionSamplingParams(
        num_steps=num_steps,
        samples_per_prompt=2,
        height=size,
        width=size,
        guidance_scale=guidance,
        eta=0.0,
        dynamic_shift=True,
        max_seq_len=8192,
        max_shift=0.9,
        sigma_grid="steps",
        shift_terminal=shift_terminal,
        max_sequence_length=max_len,
    )
    stage = QwenImageStage(bundle)
    sigmas = sigmas_for(sp, bundle.image_seq_len(size, size))
    req = RolloutReq.from_prompts([PromptExample(p, str(i)) for i, p in enumerate(PROMPTS)], sp, sigmas, 0)
    cond = stage.encode_prompts(req.prompts, sp.guidance_scale, sp.max_sequence_length)
    ours = stage.diffuse(req, cond).at(num_steps)
    shape = bundle.latent_shape(size, size)
    x_t = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in req.init_seeds]
    )

    components = dict(bundle.pipeline.components)
    if shift_terminal is not None:
        components["scheduler"] = FlowMatchEulerDiscreteScheduler.from_config(
            components["scheduler"].config, shift_terminal=shift_terminal
        )
    pipe = QwenImagePipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def keep_last(pipe, i, t, tensors):  # the packed latents after the last step, before decoding
        final["latents"] = tensors["latents"]
        return tensors

    with torch.no_grad():
        images = pipe(
            prompt=PROMPTS,
            negative_prompt=[negative] * len(PROMPTS) if guidance > 1 else None,
            true_cfg_scale=guidance,
            num_images_per_prompt=sp.samples_per_prompt,
            height=size,
            width=size,
            num_inference_steps=num_steps,
            latents=pack(x_t),
            max_sequence_length=max_len,
            output_type="pt",
            callback_on_step_end=keep_last,
        ).images
    theirs = unpack(final["latents"], *shape[1:])
    return ours, theirs, x_t, stage.decode_float(ours), images, sigmas, pipe.scheduler.sigmas


def test_template_prefix_is_the_34_tokens_the_pipeline_drops(qwen_bundle) -> None:
    pipe = qwen_bundle.pipeline
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 34
    tokens = pipe.tokenizer(pipe.prompt_template_encode.format("a red square")).input_ids[34:]
    assert pipe.tokenizer.decode(tokens[:3]) == "a red square"


@pytest.mark.parametrize(("guidance", "shift_terminal"), [(4.0, None), (1.0, 0.02)])
def test_ode_sampling_matches_qwenimage_pipeline(qwen_bundle, guidance: float, shift_terminal) -> None:
    """Negative prompt as long as the prompts, max_sequence_length = their length: bit for bit."""
    ours, theirs, x_t, our_images, images, sigmas, their_sigmas = sample_both(
        qwen_bundle, "a blue square", guidance, max_len=8, shift_terminal=shift_terminal
    )
    assert torch.equal(their_sigmas, sigmas)  # the pinned schedule is the pipeline's
    assert (ours - x_t).abs().max().item() > 0.1  # it did denoise something
    assert torch.equal(ours, theirs), f"max |stage - pipeline| = {(ours - theirs).abs().max().item()}"
    assert torch.equal(our_images, images)


def test_padded_conditioning_matches_within_the_masked_attention_rounding(qwen_bundle) -> None:
    """The negative prompt " " (6 tokens) and every prompt padded to 16: within PADDED_ATOL."""
    ours, theirs, x_t, our_images, images, _, _ = sample_both(qwen_bundle, " ", 4.0, max_len=16)
    err = (ours - theirs).abs().max().item()
    assert err <= PADDED_ATOL, f"max |stage - pipeline| = {err}"
    assert (our_images - images).abs().max().item() <= PADDED_ATOL


def test_true_cfg_is_the_norm_rescaled_combination(qwen_bundle) -> None:
    """`combine_guidance` against QwenImagePipeline's arithmetic on packed predictions, written out."""
    gen = torch.Generator().manual_seed(0)
    v_u, v_c = (torch.randn(2, 4, 6, 8, generator=gen) for _ in range(2))
    s = 4.0
    packed_u, packed_c = (QwenImagePipeline._pack_latents(v, 2, 4, 6, 8) for v in (v_u, v_c))
    comb = packed_u + s * (packed_c - packed_u)
    expected = comb * (torch.norm(packed_c, dim=-1, keepdim=True) / torch.norm(comb, dim=-1, keepdim=True))
    got = pack(qwen_bundle.combine_guidance(v_u, v_c, s))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)
    # the rescaling holds each token's norm at the cond prediction's
    torch.testing.assert_close(got.norm(dim=-1), packed_c.norm(dim=-1), rtol=1e-5, atol=0)
