"""Z-Image: ODE sampling through the shared stage equals diffusers' `ZImagePipeline` on a tiny model.

Same tiny weights (random single-stream transformer, tiny AutoencoderKL, tiny Qwen3 encoder
built offline), prompts, x_T and sigma schedule: the pipeline computes its own schedule
(`linspace(1, 1/T, T)` through its scheduler's shift 3.0), its own prompt encoding (the chat
template, second-to-last hidden states, real tokens only), its list-input transformer call at
timestep `(1000 - t) / 1000`, the negated output and its guidance pos + g (pos - neg) with g =
our scale - 1; our stage pins `sigma_grid: steps` with `shift: 3.0`, pads the captions with a
mask and cuts them back in `predict`.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import ZImagePipeline

from tests.models.lora import trained_lora_backend
from unirl.models.zimage import LORA_TARGETS, ZImageBundle, ZImageModelConfig, ZImageStage, load_checkpoint
from unirl.sde.schedules import sigmas_for
from unirl.train.backend import lora_target_problem
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

PROMPTS = ["a red square", "a blue dot"]


def tiny_config(**tiny) -> ZImageModelConfig:
    return ZImageModelConfig(tiny={"resolution": 16, "words": ["a", "red", "blue", "square", "dot"], **tiny})


@pytest.fixture(scope="module")
def bundle():
    return tiny_config().build()


@pytest.mark.parametrize(("guidance", "num_steps"), [(5.0, 4), (1.0, 3)])
def test_ode_sampling_matches_zimage_pipeline(bundle, guidance, num_steps) -> None:
    sample_both(bundle, guidance, num_steps)


@pytest.mark.parametrize(
    "options",
    [
        {"cfg_normalization": 1.05},
        {"cfg_truncation": 0.2},
        {"cfg_normalization": 1.05, "cfg_truncation": 0.2},
    ],
)
def test_cfg_normalization_and_truncation_match_the_pipelines(options) -> None:
    """The pipeline's `cfg_normalization` (guided rows rescaled to at most 1.05 x their cond
    norm) and `cfg_truncation` (the last two of 4 steps, `(1000 - t) / 1000` = 0.25 and 0.5 > 0.2,
    unguided, their uncond forward skipped) through the model config: bit-equal to
    `ZImagePipeline` with the same options, and each changes the sample."""
    plain = tiny_config().build()
    guided = tiny_config()
    for key, value in options.items():
        setattr(guided, key, value)
    ours = sample_both(guided.build(), 5.0, 4, **options)
    assert (ours - sample_both(plain, 5.0, 4)).abs().max().item() > 1e-4


def test_bad_guidance_options_are_refused() -> None:
    with pytest.raises(ValueError, match=r"model.cfg_truncation must be"):
        ZImageModelConfig(tiny={"resolution": 16}, cfg_truncation=1.5)
    with pytest.raises(ValueError, match=r"model.cfg_normalization must be >= 0"):
        ZImageModelConfig(tiny={"resolution": 16}, cfg_normalization=-1.0)


def sample_both(bundle, guidance: float, num_steps: int, **options) -> torch.Tensor:
    """The stage's ODE samples of `PROMPTS`, asserted equal to `ZImagePipeline`'s with `options`
    (its `cfg_normalization` / `cfg_truncation`) on the same x_T; returns them."""
    size = 16
    sp = DiffusionSamplingParams(
        num_steps=num_steps, samples_per_prompt=2, height=size, width=size, guidance_scale=guidance, eta=0.0,
        shift=3.0, sigma_grid="steps", max_sequence_length=16,
    )  # fmt: skip
    stage = ZImageStage(bundle)
    sigmas = sigmas_for(sp, bundle.image_seq_len(size, size))
    req = RolloutReq.from_prompts([PromptExample(p, str(i)) for i, p in enumerate(PROMPTS)], sp, sigmas, 0)
    cond = stage.encode_request(req)
    ours = stage.diffuse(req, cond).at(num_steps)
    shape = bundle.latent_shape(size, size)
    x_t = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in req.init_seeds]
    )

    pipe = ZImagePipeline(**bundle.pipeline.components)
    pipe.set_progress_bar_config(disable=True)
    final = {}

    def keep_last(pipe, i, t, tensors):
        final["latents"] = tensors["latents"]
        return tensors

    with torch.no_grad():
        images = pipe(
            prompt=list(PROMPTS), num_images_per_prompt=2, height=size, width=size, num_inference_steps=num_steps,
            guidance_scale=guidance - 1.0, latents=x_t, max_sequence_length=16, output_type="pt",
            callback_on_step_end=keep_last, **options,
        ).images  # fmt: skip
    theirs = final["latents"]
    assert torch.equal(pipe.scheduler.sigmas, sigmas)
    assert (ours - x_t).abs().max().item() > 0.1
    assert torch.equal(ours, theirs), f"max |stage - pipeline| = {(ours - theirs).abs().max().item()}"
    assert torch.equal(stage.decode_float(ours), images)
    return ours


def test_lora_targets_and_export_load_back(bundle, tmp_path) -> None:
    assert lora_target_problem(tiny_config().trainable_on_meta(), LORA_TARGETS + ["w1", "w2", "w3"]) is None
    fresh = tiny_config().build()
    fresh.save_pretrained(str(tmp_path / "base"))
    backend = trained_lora_backend(fresh.transformer, LORA_TARGETS, ZImageBundle.write_weights)
    backend.save_weights(str(tmp_path / "ckpt"), base_model=str(tmp_path / "base"))
    loaded = load_checkpoint(str(tmp_path / "ckpt"))
    sp = DiffusionSamplingParams(
        num_steps=2, samples_per_prompt=1, height=16, width=16, max_sequence_length=16
    )
    req = RolloutReq.from_prompts(
        [PromptExample(p, str(i)) for i, p in enumerate(PROMPTS)], sp, sigmas_for(sp, 16), 0
    )
    cond = ZImageStage(fresh).encode_request(req)
    x = torch.randn(2, *fresh.latent_shape(16, 16), generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        trained = fresh.predict(backend.module, x, sigma, cond)
        torch.testing.assert_close(
            loaded.predict(loaded.transformer, x, sigma, cond), trained, rtol=0, atol=1e-6
        )
        backend.module.disable_adapters()
        assert not torch.allclose(fresh.predict(backend.module, x, sigma, cond), trained, atol=1e-4)


def test_bad_tiny_configs_are_refused() -> None:
    with pytest.raises(ValueError, match=r"pixel_space must be false"):
        tiny_config(pixel_space=True)
    with pytest.raises(ValueError, match=r"text_layers must be >= 2"):
        tiny_config(text_layers=1)
    with pytest.raises(ValueError, match=r"axes_dims_rope"):
        tiny_config(axes_dims_rope=[4, 4, 4])
    assert tiny_config().size_problems(16, 18) == [
        "sampling.width=18 must be a multiple of 4 (Z-Image patches 2x2 latent cells of 2 px), e.g. 16 or 20"
    ]


def test_replay_rows_of_several_steps_truncate_row_by_row() -> None:
    """A replay batch mixing a guided step (sigma 0.9) and a truncated one (sigma 0.4 with
    `cfg_truncation` 0.2) gives each row what a call of its step alone gives (the truncated row's
    uncond branch then runs beside it, weighted 0: equal to float rounding)."""
    config = tiny_config()
    config.cfg_truncation = 0.2
    bundle = config.build()
    stage = ZImageStage(bundle)
    sp = DiffusionSamplingParams(
        num_steps=2, samples_per_prompt=1, height=16, width=16, guidance_scale=5.0, max_sequence_length=16
    )
    sigmas = sigmas_for(sp, bundle.image_seq_len(16, 16))
    req = RolloutReq.from_prompts([PromptExample(p, str(i)) for i, p in enumerate(PROMPTS)], sp, sigmas, 0)
    cond = stage.encode_request(req)
    x = torch.randn(2, *bundle.latent_shape(16, 16), generator=torch.Generator().manual_seed(0))
    sigma = torch.tensor([0.9, 0.4])
    with torch.no_grad():
        both = stage.velocity(x, sigma, cond, 5.0)
        alone = [
            stage.velocity(x[i : i + 1], sigma[i : i + 1], {k: v[i : i + 1] for k, v in cond.items()}, 5.0)
            for i in range(2)
        ]
        unguided = stage.velocity(x[1:], sigma[1:], {k: v[1:] for k, v in cond.items()}, 1.0)
    torch.testing.assert_close(both, torch.cat(alone), rtol=0, atol=1e-5)
    assert torch.equal(alone[1], unguided)  # the truncated step alone: the cond branch only
