"""FLUX.1-Kontext: ODE sampling through the shared stage equals diffusers' `FluxKontextPipeline`
on a tiny model given the same condition image, and a bad condition is named with its row.

Same tiny weights (the tiny latent-space FLUX.1 of this package, as a `FluxKontextPipeline`),
prompts, condition images, x_T and sigma schedule. The pipeline encodes its `image` (resize,
preprocess, the VAE's mode, shift and scale), appends its packed tokens with position ids
(1, row, col) after the sample's and reads the velocity from the sample's tokens; our stage
encodes the image once per request (`encode_conditions`) and does the same in `predict`, so the
final latents and the decoded images agree bit for bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import FluxKontextPipeline
from PIL import Image

from tests.models.flux.conftest import tiny_flux_config
from unirl.models.flux import FluxKontextModelConfig, FluxStage, TinyFluxConfig
from unirl.models.flux.bundle import pack, unpack
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

PROMPTS = ["make it red", "make it blue"]


def kontext_config(**overrides) -> FluxKontextModelConfig:
    base = tiny_flux_config(**overrides)
    return FluxKontextModelConfig(tiny=TinyFluxConfig(**vars(base.tiny)))


@pytest.fixture(scope="module")
def kontext_bundle():
    return kontext_config().build()


def source_image(seed: int, size: int = 32) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8), "RGB")


@pytest.mark.parametrize(("num_steps", "guidance", "size", "ref"), [(4, 2.5, 32, 32), (2, 1.0, 16, 32)])
def test_ode_sampling_matches_flux_kontext_pipeline(kontext_bundle, num_steps, guidance, size, ref) -> None:
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
    images = [source_image(i, ref) for i in range(len(PROMPTS))]
    stage = FluxStage(kontext_bundle)
    sigmas = sigmas_for(sp, kontext_bundle.image_seq_len(size, size))
    examples = [PromptExample(p, str(i), {"images": [images[i]]}) for i, p in enumerate(PROMPTS)]
    req = RolloutReq.from_prompts(examples, sp, sigmas, 0)
    cond = stage.encode_prompts(req.prompts, sp.guidance_scale, sp.max_sequence_length)
    cond.update(stage.encode_conditions(req))
    assert set(cond) == {"prompt_embeds", "pooled_prompt_embeds", "image_latents"}
    assert cond["image_latents"].shape == (4, 4, ref // 2, ref // 2)
    ours = stage.diffuse(req, cond).at(num_steps)
    shape = kontext_bundle.latent_shape(size, size)
    x_t = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in req.init_seeds])

    pipe = FluxKontextPipeline(**kontext_bundle.pipeline.components)
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def keep_last(pipe, i, t, tensors):
        final["latents"] = tensors["latents"]
        return tensors

    with torch.no_grad():
        decoded = pipe(
            image=[im for im in images for _ in range(sp.samples_per_prompt)],
            prompt=[p for p in PROMPTS for _ in range(sp.samples_per_prompt)],
            height=size,
            width=size,
            max_area=size * size,
            _auto_resize=False,
            num_inference_steps=num_steps,
            guidance_scale=guidance,
            latents=pack(x_t),
            max_sequence_length=sp.max_sequence_length,
            output_type="pt",
            callback_on_step_end=keep_last,
        ).images
    theirs = unpack(final["latents"], *shape[1:])
    assert torch.equal(pipe.scheduler.sigmas, sigmas)
    assert (ours - x_t).abs().max().item() > 0.1
    assert torch.equal(ours, theirs), f"max |stage - pipeline| = {(ours - theirs).abs().max().item()}"
    assert torch.equal(stage.decode_float(ours), decoded)


def test_the_condition_image_changes_the_sample(kontext_bundle) -> None:
    """The same prompt, seed and noise with another reference image gives another velocity: the
    reference tokens are attended to, not dropped."""
    stage = FluxStage(kontext_bundle)
    sp = DiffusionSamplingParams(num_steps=2, samples_per_prompt=1, height=16, width=16, eta=0.0)
    sigmas = sigmas_for(sp, kontext_bundle.image_seq_len(16, 16))
    velocities = []
    for seed in (0, 1):
        req = RolloutReq.from_prompts([PromptExample("edit", "0", {"images": [source_image(seed)]})], sp, sigmas, 0)
        cond = {**stage.encode_prompts(req.prompts, 1.0, 8), **stage.encode_conditions(req)}
        x = torch.zeros(1, *kontext_bundle.latent_shape(16, 16))
        velocities.append(stage.velocity(x, sigmas[:1], cond, 1.0))
    assert (velocities[0] - velocities[1]).abs().max().item() > 1e-4


def test_a_bad_condition_is_named_with_its_sample(kontext_bundle, tmp_path) -> None:
    stage = FluxStage(kontext_bundle)
    sp = DiffusionSamplingParams(num_steps=2, samples_per_prompt=1, height=16, width=16, eta=0.0)
    sigmas = sigmas_for(sp, kontext_bundle.image_seq_len(16, 16))

    def req(metadata):
        return RolloutReq.from_prompts([PromptExample("edit", "row7", metadata)], sp, sigmas, 0)

    with pytest.raises(ValueError, match=r"row7.*one condition image.*got none"):
        stage.encode_conditions(req({}))
    with pytest.raises(ValueError, match=r"row7.*got 2"):
        stage.encode_conditions(req({"images": [source_image(0), source_image(1)]}))
    with pytest.raises(ValueError, match=r"row7.*30x30 px.*multiples of 4 px"):
        stage.encode_conditions(req({"images": [source_image(0, 30)]}))
    with pytest.raises(ValueError, match=r"row7.*no image file"):
        stage.encode_conditions(req({"images": [str(tmp_path / "missing.png")]}))


def test_condition_problems_name_the_row_before_any_run(tmp_path) -> None:
    """The validator's check of a prompt file's conditions (`condition_problems`): a row without an
    image, with two, with an unreadable file, of a size the packing cannot take, or of another
    size than the others."""
    good, odd, other = tmp_path / "a.png", tmp_path / "b.png", tmp_path / "c.png"
    source_image(0, 32).save(good)
    source_image(1, 30).save(odd)
    source_image(2, 16).save(other)
    examples = [
        PromptExample("ok", "ok", {"images": [str(good)]}),
        PromptExample("none", "none", {}),
        PromptExample("two", "two", {"images": [str(good), str(good)]}),
        PromptExample("gone", "gone", {"images": [str(tmp_path / "gone.png")]}),
        PromptExample("odd", "odd", {"images": [str(odd)]}),
        PromptExample("small", "small", {"images": [str(other)]}),
    ]
    found = kontext_config().condition_problems(examples, "data_source")
    text = "\n".join(found)
    assert "prompt 'none' carries no condition image" in text and "prompt 'two' carries 2" in text
    assert "'gone'" in text and "no image file" in text
    assert "prompt 'odd'" in text and "30x30 px" in text and "multiples of 4 px" in text
    assert "several sizes" in text
    assert kontext_config().condition_problems(examples[:1], "data_source") == []
