"""FLUX.2-dev and FLUX.2-Klein: ODE sampling through the shared stage equals diffusers'
`Flux2Pipeline` / `Flux2KleinPipeline` on tiny models.

Same tiny weights (random transformer, tiny `AutoencoderKLFlux2` with non-trivial batch-norm
statistics, a tiny Mistral 3 / Qwen3 prompt encoder as deep as the real ones' stacked layers),
prompts, x_T and schedule: the pipelines compute their own schedule (`linspace(1, 1/T, T)` under
FLUX.2's empirical mu from their token count and step count), their own prompt encoding, their
4-axis positions, their patchify-and-flatten of the normalised latents (handed the stage's x_T
patchified) and their decode; the stage pins `sigma_grid: steps`, `dynamic_shift: true`,
`mu_rule: empirical`, packs [B, C, h, w] 2x2 and unpatchifies in `pixels`.
"""

from __future__ import annotations

import pytest
import torch

from tests.models.lora import trained_lora_backend
from unirl.models.flux2 import (
    LORA_TARGETS,
    Flux2KleinModelConfig,
    Flux2ModelConfig,
    Flux2Stage,
)
from unirl.sde.schedules import sigmas_for
from unirl.train.backend import lora_target_problem
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

PROMPTS = ["a red square", "a blue dot"]
WORDS = ["a", "red", "blue", "square", "dot"]
SIZE = 32
LENGTH = 48  # the system message takes 26 of FLUX.2-dev's tokens


def dev_config(**tiny) -> Flux2ModelConfig:
    return Flux2ModelConfig(tiny={"resolution": SIZE, "words": WORDS, **tiny})


def klein_config(**tiny) -> Flux2KleinModelConfig:
    return Flux2KleinModelConfig(tiny={"resolution": SIZE, "words": WORDS, **tiny})


@pytest.fixture(scope="module")
def dev():
    return dev_config().build()


@pytest.fixture(scope="module")
def klein():
    return klein_config().build()


def stage_and_pipeline(bundle, guidance: float, num_steps: int):
    """(the stage's final latents [B, C, h, w], x_T, the pipeline's final latents and images,
    its sigmas, the stage's decode) on the same prompts, x_T and guidance."""
    sp = DiffusionSamplingParams(
        num_steps=num_steps, samples_per_prompt=2, height=SIZE, width=SIZE, guidance_scale=guidance, eta=0.0,
        sigma_grid="steps", dynamic_shift=True, mu_rule="empirical", max_sequence_length=LENGTH,
    )  # fmt: skip
    stage = Flux2Stage(bundle)
    sigmas = sigmas_for(sp, bundle.image_seq_len(SIZE, SIZE))
    req = RolloutReq.from_prompts([PromptExample(p, str(i)) for i, p in enumerate(PROMPTS)], sp, sigmas, 0)
    ours = stage.diffuse(req, stage.encode_request(req)).at(num_steps)
    shape = bundle.latent_shape(SIZE, SIZE)
    x_t = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in req.init_seeds]
    )

    pipe = type(bundle).PIPELINE(**bundle.pipeline.components)
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def keep_last(pipe, i, t, tensors):
        final["latents"] = tensors["latents"]
        return tensors

    with torch.no_grad():
        images = pipe(
            prompt=list(PROMPTS), num_images_per_prompt=2, height=SIZE, width=SIZE, num_inference_steps=num_steps,
            guidance_scale=guidance, latents=pipe._patchify_latents(x_t), max_sequence_length=LENGTH,
            output_type="pt", callback_on_step_end=keep_last,
        ).images  # fmt: skip
    h, w = shape[1:]
    theirs = pipe._unpatchify_latents(final["latents"].transpose(1, 2).reshape(len(x_t), -1, h // 2, w // 2))
    assert torch.equal(pipe.scheduler.sigmas, sigmas)
    return ours, x_t, theirs, images, stage.decode_float(ours)


@pytest.mark.parametrize(("guidance", "num_steps"), [(4.0, 4), (1.0, 3)])
def test_dev_ode_sampling_matches_flux2_pipeline(dev, guidance, num_steps) -> None:
    ours, x_t, theirs, images, decoded = stage_and_pipeline(dev, guidance, num_steps)
    assert (ours - x_t).abs().max().item() > 0.1
    assert torch.equal(ours, theirs), f"max |stage - pipeline| = {(ours - theirs).abs().max().item()}"
    assert torch.equal(decoded, images)


@pytest.mark.parametrize(("guidance", "num_steps"), [(4.0, 4), (1.0, 3)])
def test_klein_ode_sampling_matches_flux2_klein_pipeline(klein, guidance, num_steps) -> None:
    ours, x_t, theirs, images, decoded = stage_and_pipeline(klein, guidance, num_steps)
    assert (ours - x_t).abs().max().item() > 0.1
    assert torch.equal(ours, theirs), f"max |stage - pipeline| = {(ours - theirs).abs().max().item()}"
    assert torch.equal(decoded, images)


def test_the_guidance_changes_the_sample(dev, klein) -> None:
    """The scale reaches the network (dev: an input; Klein: the uncond branch's weight)."""
    for bundle in (dev, klein):
        one, *_ = stage_and_pipeline(bundle, 1.0, 2)
        four, *_ = stage_and_pipeline(bundle, 4.0, 2)
        assert (one - four).abs().max().item() > 1e-3


@pytest.mark.parametrize("klein_model", [False, True])
def test_lora_targets_and_export_load_back(klein_model, tmp_path) -> None:
    config = klein_config() if klein_model else dev_config()
    assert lora_target_problem(config.trainable_on_meta(), LORA_TARGETS + ["linear_in", "linear_out"]) is None
    fresh = config.build()
    fresh.save_pretrained(str(tmp_path / "base"))
    backend = trained_lora_backend(fresh.transformer, LORA_TARGETS, type(fresh).write_weights)
    backend.save_weights(str(tmp_path / "ckpt"), base_model=str(tmp_path / "base"))
    loaded = config.load_checkpoint(str(tmp_path / "ckpt"))
    assert type(loaded) is type(fresh)
    cond = fresh.encode_text(PROMPTS, guided=False, max_sequence_length=LENGTH)
    x = torch.randn(2, *fresh.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.3, 0.8])
    extra = {"guidance": torch.full_like(sigma, 4.0)} if not klein_model else {}
    with torch.no_grad():
        trained = fresh.predict(backend.module, x, sigma, cond, **extra)
        torch.testing.assert_close(
            loaded.predict(loaded.transformer, x, sigma, cond, **extra), trained, rtol=0, atol=1e-6
        )
        backend.module.disable_adapters()
        assert not torch.allclose(fresh.predict(backend.module, x, sigma, cond, **extra), trained, atol=1e-4)


def test_bad_configs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"pixel_space must be false"):
        dev_config(pixel_space=True)
    with pytest.raises(ValueError, match=r"text_layers=12: .* at least 30 layers"):
        dev_config(text_layers=12)
    with pytest.raises(ValueError, match=r"text_layers=26: .* at least 27 layers"):
        klein_config(text_layers=26)
    with pytest.raises(ValueError, match=r"axes_dims_rope=\[4, 6, 6\] must be 4 even sizes"):
        dev_config(axes_dims_rope=[4, 6, 6])
    with pytest.raises(ValueError, match=r"guidance_embeds must be false for FLUX.2-Klein"):
        klein_config(guidance_embeds=True)
    assert dev_config().size_problems(32, 34) == [
        "sampling.width=34 must be a multiple of 4 (FLUX.2 patches 2x2 latent cells of 2 px), e.g. 32 or 36"
    ]
    assert dev_config(guidance_embeds=False).guidance_problems(4.0, "sampling.guidance_scale")
    assert dev_config().guidance_problems(4.0, "sampling.guidance_scale") == []


def test_predict_takes_the_guidance_its_transformer_embeds(dev, klein) -> None:
    cond = dev.encode_text(PROMPTS[:1], guided=False, max_sequence_length=LENGTH)
    x, sigma = torch.randn(1, *dev.latent_shape(SIZE, SIZE)), torch.tensor([0.5])
    with pytest.raises(ValueError, match=r"this FLUX.2 transformer embeds the guidance scale"):
        dev.predict(dev.transformer, x, sigma, cond)
    cond = klein.encode_text(PROMPTS[:1], guided=False, max_sequence_length=LENGTH)
    with pytest.raises(ValueError, match=r"has no guidance embedding .* must be 1.0"):
        klein.predict(klein.transformer, x, sigma, cond, guidance=torch.tensor([4.0]))
    with torch.no_grad():  # 1.0 is no guidance: the same velocity as none
        torch.testing.assert_close(
            klein.predict(klein.transformer, x, sigma, cond, guidance=torch.tensor([1.0])),
            klein.predict(klein.transformer, x, sigma, cond),
            rtol=0, atol=0,
        )
