"""HunyuanVideo 1.5: ODE sampling through the shared stage equals diffusers'
`HunyuanVideo15Pipeline` on a tiny model.

Same tiny weights (a random transformer, a tiny causal VAE, a tiny Qwen2.5-VL text model whose
tokenizer crops the template's 108 tokens as the real one does, a tiny ByT5), prompts (one quoting
text, so the glyph encoder runs), x_T and schedule: the pipeline computes its own schedule
(`linspace(1, 0, T + 1)[:-1]` through its scheduler's shift 5.0), both prompt encodings, its
guider's classifier-free guidance (`guidance_scale` ours) in separate cond / uncond forwards, the
zero condition latents, mask and image stream; the stage pins `sigma_grid: steps` with `shift:
5.0`. The pipeline's VAE decode takes one video at a time (its mid-block attention mask broadcasts
only for a batch of 1), so its frames are compared on a one-sample run; and it sizes its image
stream by prompts, not videos (a batch of several videos per prompt fails in its transformer), so
it runs one video per prompt. Both are diffusers 0.42 limits; the stage has neither.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import HunyuanVideo15Pipeline
from diffusers.guiders import ClassifierFreeGuidance as Guider

from tests.models.lora import trained_lora_backend
from unirl.models.hunyuanvideo import LORA_TARGETS, HunyuanVideo15ModelConfig, HunyuanVideo15Stage
from unirl.sde.schedules import sigmas_for
from unirl.train.backend import lora_target_problem
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

PROMPTS = ["a red square", 'a sign saying "HI"']
SIZE, FRAMES, LENGTH = 16, 5, 16


def tiny_config(**tiny) -> HunyuanVideo15ModelConfig:
    words = ["a", "red", "square", "sign", "saying"]
    return HunyuanVideo15ModelConfig(tiny={"resolution": SIZE, "words": words, **tiny}, num_frames=FRAMES)


@pytest.fixture(scope="module")
def bundle():
    return tiny_config().build()


def sample(bundle, prompts: list[str], per_prompt: int, guidance: float, num_steps: int, output_type: str):
    """(the stage's final latents, x_T, the pipeline's output and its sigmas, the stage's decode)."""
    sp = DiffusionSamplingParams(
        num_steps=num_steps, samples_per_prompt=per_prompt, height=SIZE, width=SIZE, guidance_scale=guidance,
        eta=0.0, shift=5.0, sigma_grid="steps", max_sequence_length=LENGTH,
    )  # fmt: skip
    stage = HunyuanVideo15Stage(bundle)
    sigmas = sigmas_for(sp, bundle.image_seq_len(SIZE, SIZE))
    req = RolloutReq.from_prompts([PromptExample(p, str(i)) for i, p in enumerate(prompts)], sp, sigmas, 0)
    ours = stage.diffuse(req, stage.encode_request(req)).at(num_steps)
    shape = bundle.latent_shape(SIZE, SIZE)
    x_t = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in req.init_seeds]
    )
    pipe = HunyuanVideo15Pipeline(**{**bundle.pipeline.components, "guider": Guider(guidance_scale=guidance)})
    pipe.tokenizer_max_length = (
        LENGTH  # the pipeline's own knob for what the recipe calls max_sequence_length
    )
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        out = pipe(
            prompt=list(prompts), num_videos_per_prompt=per_prompt, height=SIZE, width=SIZE, num_frames=FRAMES,
            num_inference_steps=num_steps, latents=x_t, output_type=output_type,
        ).frames  # fmt: skip
    assert torch.equal(pipe.scheduler.sigmas, sigmas)
    return ours, x_t, out, stage


@pytest.mark.parametrize(("guidance", "num_steps"), [(6.0, 4), (1.0, 3)])
def test_ode_sampling_matches_hunyuanvideo15_pipeline(bundle, guidance, num_steps) -> None:
    ours, x_t, theirs, _ = sample(bundle, PROMPTS, 1, guidance, num_steps, "latent")
    assert ours.shape == (2, 4, 3, SIZE // 2, SIZE // 2)
    assert (ours - x_t).abs().max().item() > 0.1
    assert torch.equal(ours, theirs), f"max |stage - pipeline| = {(ours - theirs).abs().max().item()}"


def test_decode_matches_the_pipelines_frames(bundle) -> None:
    ours, _, frames, stage = sample(bundle, PROMPTS[1:], 1, 6.0, 2, "pt")
    assert frames.shape == (1, FRAMES, 3, SIZE, SIZE)
    assert torch.equal(stage.decode_float(ours), frames)
    # a batch decodes sample by sample: the same frames as each alone
    two = torch.cat([ours, ours.flip(-1)])
    assert torch.equal(bundle.pixels(two)[1], bundle.pixels(ours.flip(-1))[0])


def test_quoted_text_reaches_the_glyph_encoder(bundle) -> None:
    cond = bundle.encode_text(PROMPTS, guided=True, max_sequence_length=LENGTH)
    assert cond["prompt_embeds_mask_2"].sum(1).tolist()[0] == 0 and cond["prompt_embeds_mask_2"][1].sum() > 0
    assert cond["negative_prompt_embeds_mask_2"].sum() == 0
    assert cond["prompt_embeds"].shape == (2, LENGTH, 16)


def test_lora_targets_and_export_load_back(bundle, tmp_path) -> None:
    config = tiny_config()
    assert (
        lora_target_problem(config.trainable_on_meta(), LORA_TARGETS + ["ff.net.0.proj", "ff.net.2"]) is None
    )
    fresh = config.build()
    fresh.save_pretrained(str(tmp_path / "base"))
    backend = trained_lora_backend(fresh.transformer, LORA_TARGETS, type(fresh).write_weights)
    backend.save_weights(str(tmp_path / "ckpt"), base_model=str(tmp_path / "base"))
    loaded = config.load_checkpoint(str(tmp_path / "ckpt"))
    cond = fresh.encode_text(PROMPTS, guided=False, max_sequence_length=LENGTH)
    x = torch.randn(2, *fresh.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        trained = fresh.predict(backend.module, x, sigma, cond)
        torch.testing.assert_close(
            loaded.predict(loaded.transformer, x, sigma, cond), trained, rtol=0, atol=1e-6
        )
        backend.module.disable_adapters()
        assert not torch.allclose(fresh.predict(backend.module, x, sigma, cond), trained, atol=1e-4)


def test_bad_configs_are_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"rope_axes_dim=\[4, 4, 4\] must be 3 even sizes summing to"):
        tiny_config(rope_axes_dim=[4, 4, 4])
    with pytest.raises(ValueError, match=r"text_layers must be >= 2"):
        tiny_config(text_layers=1)
    with pytest.raises(ValueError, match=r"vae_widths=\[8\] needs more than 1 levels"):
        tiny_config(vae_widths=[8])
    assert tiny_config().size_problems(16, 17) == [
        "sampling.width=17 must be a multiple of 2 (the HunyuanVideo 1.5 VAE's spatial compression: one token per latent cell), "
        "e.g. 16 or 18"
    ]
    config = HunyuanVideo15ModelConfig(tiny={"resolution": SIZE}, num_frames=6)
    assert any("model.num_frames=6" in p for p in config.size_problems(16, 16))
    directory = tmp_path / "hv"
    tiny_config().build().save_pretrained(str(directory))
    assert (
        HunyuanVideo15ModelConfig(
            pretrained_path=str(directory), tiny=None, num_frames=5
        ).directory_problems()
        == []
    )
    guider = directory / "guider" / "guider_config.json"
    guider.write_text(guider.read_text().replace('"guidance_rescale": 0.0', '"guidance_rescale": 0.7'))
    problems = HunyuanVideo15ModelConfig(
        pretrained_path=str(directory), tiny=None, num_frames=5
    ).directory_problems()
    assert len(problems) == 1 and "'guidance_rescale': 0.7" in problems[0]
