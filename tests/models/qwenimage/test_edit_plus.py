"""Qwen-Image-Edit-Plus: ODE sampling through the shared stage equals diffusers'
`QwenImageEditPlusPipeline` on a tiny model given the same references, and bad references are named
with their row.

Same tiny weights (the tiny latent-space Qwen-Image of this package with its Qwen2.5-VL encoder,
as a `QwenImageEditPlusPipeline` with a still-image processor), prompts, references, x_T and sigma
schedule. The pipeline resizes each reference for its prompt encoder and its VAE (its module
constants `CONDITION_IMAGE_SIZE` / `VAE_IMAGE_SIZE`, patched here to the tiny recipe's areas, as
the model config's `condition_area` / `vae_area` set them for our bundle), encodes the prompt with
the references' vision tokens, VAE-encodes each reference, appends their packed tokens after the
sample's with one `img_shapes` entry each, and reads the velocity from the sample's tokens; our
stage encodes each row once per request (`encode_conditions`) and does the same in `predict`. The
pipeline takes one prompt per call, so it runs per row with `num_images_per_prompt`; with
`max_sequence_length` the encoded length (no padding) and one row per request (the pipeline's
batch) the final latents and the decoded images agree bit for bit; both rows in one request agree
within 1e-5 (a batch of 4 runs other GEMM kernels than a batch of 2 on some CPUs).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit_plus as edit_plus
from PIL import Image

from tests.models.lora import trained_lora_backend
from unirl.models.qwenimage import QwenImageEditPlusModelConfig, QwenImageStage
from unirl.models.qwenimage.bundle import pack, unpack
from unirl.sde.schedules import sigmas_for
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

PROMPTS = ["make it red", "make it blue"]  # the same token count, so one length serves both rows
AREAS = {"condition_area": 56 * 56, "vae_area": 32 * 32}


def edit_config(**tiny) -> QwenImageEditPlusModelConfig:
    base = dict(resolution=32, words=["make", "it", "red", "blue"], seed=0)
    return QwenImageEditPlusModelConfig(tiny={**base, **tiny}, **AREAS)


@pytest.fixture(scope="module")
def edit_bundle():
    return edit_config().build()


def source_image(seed: int, width: int = 32, height: int = 32) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), "RGB")


def request(bundle, rows: list[list[Image.Image]], sp: DiffusionSamplingParams) -> RolloutReq:
    sigmas = sigmas_for(sp, bundle.image_seq_len(sp.height, sp.width))
    examples = [
        PromptExample(p, str(i), {"images": refs})
        for i, (p, refs) in enumerate(zip(PROMPTS, rows, strict=True))
    ]
    return RolloutReq.from_prompts(examples, sp, sigmas, 0)


def encoded_length(bundle, prompt: str, refs: list[Image.Image]) -> int:
    """Tokens of `prompt` with `refs` after the template's 64 dropped ones (no padding)."""
    sp = DiffusionSamplingParams(
        num_steps=1, samples_per_prompt=1, height=32, width=32, max_sequence_length=1024
    )
    req = RolloutReq.from_prompts([PromptExample(prompt, "0", {"images": refs})], sp, sigmas_for(sp, 64), 0)
    return int(bundle.encode_conditions(req, guided=False)["prompt_embeds_mask"].sum())


@pytest.mark.parametrize(
    ("num_refs", "guidance", "zero_cond_t"), [(1, 4.0, False), (2, 1.0, False), (2, 4.0, True)]
)
def test_ode_sampling_matches_qwenimage_edit_plus_pipeline(
    monkeypatch, num_refs, guidance, zero_cond_t
) -> None:
    bundle = edit_config(zero_cond_t=zero_cond_t).build()
    bundle.negative_prompt = "make it blue"  # as long as the prompts: no padding on either branch
    rows = [[source_image(10 * i + k, 32, 32 if k == 0 else 96) for k in range(num_refs)] for i in range(2)]
    length = encoded_length(bundle, PROMPTS[0], rows[0])
    sp = DiffusionSamplingParams(
        num_steps=3, samples_per_prompt=2, height=32, width=32, guidance_scale=guidance, eta=0.0,
        dynamic_shift=True, max_seq_len=8192, max_shift=0.9, sigma_grid="steps", max_sequence_length=length,
    )  # fmt: skip
    stage = QwenImageStage(bundle)
    req = request(bundle, rows, sp)
    cond = stage.encode_request(req)
    expected = {"prompt_embeds", "prompt_embeds_mask", "image_latents", "image_shapes"}
    if guidance > 1:
        expected |= {"negative_prompt_embeds", "negative_prompt_embeds_mask"}
    assert set(cond) == expected
    # a 32x32 reference: 32x32 px for the VAE (2x down, 2x2 packed): 8x8 tokens; a 32x96 one: 32x64 px, 16x8
    grids = [[8, 8], [16, 8]][:num_refs]
    assert cond["image_shapes"][0].tolist() == grids
    assert cond["image_latents"].shape == (4, sum(r * c for r, c in grids), 16)
    ours = stage.diffuse(req, cond).at(sp.num_steps)

    monkeypatch.setattr(edit_plus, "CONDITION_IMAGE_SIZE", AREAS["condition_area"])
    monkeypatch.setattr(edit_plus, "VAE_IMAGE_SIZE", AREAS["vae_area"])
    pipe = QwenImageEditPlusPipeline(**bundle.pipeline.components)
    pipe.set_progress_bar_config(disable=True)

    def pipeline_row(i: int, x_t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The pipeline on row i's prompt and references from x_t [2, C, h, w]: (final latents,
        images); it takes one prompt per call, with `num_images_per_prompt`."""
        final = {}

        def keep_last(pipe, step, t, tensors):  # the packed latents after the last step
            final["latents"] = tensors["latents"]
            return tensors

        with torch.no_grad():
            images = pipe(
                image=rows[i], prompt=PROMPTS[i], negative_prompt=bundle.negative_prompt if guidance > 1 else None,
                true_cfg_scale=guidance, num_images_per_prompt=sp.samples_per_prompt, height=32, width=32,
                num_inference_steps=sp.num_steps, latents=pack(x_t), output_type="pt", callback_on_step_end=keep_last,
            ).images  # fmt: skip
        assert torch.equal(pipe.scheduler.sigmas, req.sigmas)
        return unpack(final["latents"], *x_t.shape[2:]), images

    def x_t_of(r: RolloutReq) -> torch.Tensor:
        shape = bundle.latent_shape(32, 32)
        return torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in r.init_seeds])

    # one row per request, the pipeline's batch: equal bit for bit
    for i in range(2):
        one = RolloutReq.from_prompts([PromptExample(PROMPTS[i], str(i), {"images": rows[i]})], sp, req.sigmas, 0)
        x_t = x_t_of(one)
        mine = stage.diffuse(one, stage.encode_request(one)).at(sp.num_steps)
        theirs, images = pipeline_row(i, x_t)
        assert (mine - x_t).abs().max().item() > 0.1
        assert torch.equal(mine, theirs), f"max |stage - pipeline| = {(mine - theirs).abs().max().item()}"
        assert torch.equal(stage.decode_float(mine), images)
    # both rows in one batch: each row's samples as the pipeline's within float rounding (a batch of
    # 4 is not a batch of 2 to every CPU's GEMM kernels: bit-equal on an AVX-512 machine, 1.2e-6 on AVX2)
    x_t = x_t_of(req)
    theirs = torch.cat([pipeline_row(i, x_t[2 * i : 2 * i + 2])[0] for i in range(2)])
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)


def test_template_prefix_is_the_64_tokens_the_pipeline_drops(edit_bundle) -> None:
    pipe = edit_bundle.pipeline
    prefix = pipe.prompt_template_encode.split("{}")[0]
    assert len(pipe.tokenizer(prefix).input_ids) == pipe.prompt_template_encode_start_idx == 64


def test_the_prompt_encoder_and_the_transformer_see_the_references(edit_bundle) -> None:
    """Another reference changes the prompt embedding (the VL encoder reads it) and the velocity
    (its tokens are attended to), the same prompt, seed and noise otherwise."""
    stage = QwenImageStage(edit_bundle)
    sp = DiffusionSamplingParams(
        num_steps=2, samples_per_prompt=1, height=32, width=32, eta=0.0, max_sequence_length=64
    )
    embeds, velocities = [], []
    for seed in (0, 1):
        req = request(edit_bundle, [[source_image(seed)], [source_image(seed)]], sp)
        cond = stage.encode_request(req)
        embeds.append(cond["prompt_embeds"])
        x = torch.zeros(2, *edit_bundle.latent_shape(32, 32))
        velocities.append(stage.velocity(x, req.sigmas[:1].expand(2), cond, 1.0))
    assert (embeds[0] - embeds[1]).abs().max().item() > 1e-4
    assert (velocities[0] - velocities[1]).abs().max().item() > 1e-4


def test_bad_references_are_named_with_their_sample(edit_bundle, tmp_path) -> None:
    stage = QwenImageStage(edit_bundle)
    sp = DiffusionSamplingParams(
        num_steps=2, samples_per_prompt=1, height=32, width=32, eta=0.0, max_sequence_length=64
    )

    def req(*metadata):
        examples = [PromptExample("make it red", f"row{i}", m) for i, m in enumerate(metadata)]
        return RolloutReq.from_prompts(examples, sp, sigmas_for(sp, 64), 0)

    with pytest.raises(ValueError, match=r"row0.*one or more reference images.*got none"):
        stage.encode_conditions(req({}))
    with pytest.raises(ValueError, match=r"row0.*images\[1\].*no image file"):
        stage.encode_conditions(req({"images": [source_image(0), str(tmp_path / "missing.png")]}))
    with pytest.raises(ValueError, match=r"row1.*\(128, 16\).*\(64, 16\).*row0.*same number of references"):
        stage.encode_conditions(req({"images": [source_image(0)]}, {"images": [source_image(0)] * 2}))
    short = DiffusionSamplingParams(
        num_steps=2, samples_per_prompt=1, height=32, width=32, max_sequence_length=8
    )
    one = RolloutReq.from_prompts(
        [PromptExample("make it red", "row9", {"images": [source_image(0)]})], short, sigmas_for(short, 64), 0
    )
    with pytest.raises(ValueError, match=r"row9.*encodes to \d+ tokens.*max_sequence_length=8"):
        stage.encode_conditions(one)


def test_condition_problems_name_the_row_before_any_run(tmp_path) -> None:
    """The validator's check of a prompt file's references: a row without one, an unreadable
    file, a reference too thin to resize, rows whose references pack differently."""
    square, wide, thin = tmp_path / "a.png", tmp_path / "b.png", tmp_path / "c.png"
    source_image(0).save(square)
    source_image(1, 96, 32).save(wide)
    source_image(2, 640, 8).save(thin)
    config = edit_config()
    rows = [
        PromptExample("make it red", "ok", {"images": [str(square)]}),
        PromptExample("make it red", "bare", {}),
        PromptExample("make it red", "lost", {"images": [str(tmp_path / "gone.png")]}),
        PromptExample("make it red", "thin", {"images": [str(thin)]}),
        PromptExample("make it red", "wide", {"images": [str(wide)]}),
    ]
    problems = config.condition_problems(rows, "data_source")
    assert len(problems) == 4, problems
    assert "prompt 'bare' carries no reference image in metadata 'images'" in problems[0]
    assert "'lost'" in problems[1] and "no image file" in problems[1]
    assert "prompt 'thin'" in problems[2] and "model.vae_area=1024" in problems[2]
    assert "different token grids" in problems[3] and "'ok'" in problems[3] and "'wide'" in problems[3]
    assert config.condition_problems(rows[:1], "data_source") == []


def test_a_pixel_space_edit_model_packs_its_references_pixels() -> None:
    """No VAE: a reference's preprocessed pixels in [-1, 1], packed 2x2, are its tokens."""
    bundle = edit_config(pixel_space=True).build()
    sp = DiffusionSamplingParams(
        num_steps=2, samples_per_prompt=1, height=16, width=16, max_sequence_length=64
    )
    image = source_image(3)
    cond = QwenImageStage(bundle).encode_request(request(bundle, [[image], [image]], sp))
    pixels = torch.tensor(np.asarray(image), dtype=torch.float32).permute(2, 0, 1) / 127.5 - 1
    torch.testing.assert_close(cond["image_latents"][:1], pack(pixels[None]), rtol=0, atol=1e-6)
    assert cond["image_shapes"][0].tolist() == [[16, 16]]


def test_exported_lora_loads_back_through_the_edit_pipeline(tmp_path) -> None:
    """A trained LoRA saved by the train backend loads into a `QwenImageEditPlusPipeline` read back
    from the saved base directory (its processor through `StillImageQwenVLProcessor`), and changes
    the edit: the loaded model's velocity on a row with its reference is the trained one, not the
    base's."""
    from unirl.models.qwenimage import LORA_TARGETS, QwenImageEditPlusBundle

    config = edit_config()
    edit_bundle = config.build()
    edit_bundle.save_pretrained(str(tmp_path / "base"))
    backend = trained_lora_backend(edit_bundle.transformer, LORA_TARGETS, QwenImageEditPlusBundle.write_weights)
    backend.save_weights(str(tmp_path / "ckpt"), base_model=str(tmp_path / "base"))
    loaded = config.load_checkpoint(str(tmp_path / "ckpt"))
    assert isinstance(loaded, QwenImageEditPlusBundle) and isinstance(
        loaded.pipeline, QwenImageEditPlusPipeline
    )
    assert (loaded.condition_area, loaded.vae_area) == (AREAS["condition_area"], AREAS["vae_area"])

    sp = DiffusionSamplingParams(
        num_steps=2, samples_per_prompt=1, height=32, width=32, max_sequence_length=64
    )
    req = request(edit_bundle, [[source_image(0)], [source_image(1)]], sp)
    cond = QwenImageStage(edit_bundle).encode_request(req)
    torch.testing.assert_close(QwenImageStage(loaded).encode_request(req), cond, rtol=0, atol=0)
    x = torch.randn(2, *edit_bundle.latent_shape(32, 32), generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        trained = edit_bundle.predict(backend.module, x, sigma, cond)
        torch.testing.assert_close(
            loaded.predict(loaded.transformer, x, sigma, cond), trained, rtol=0, atol=1e-6
        )
        backend.module.disable_adapters()
        assert not torch.allclose(edit_bundle.predict(backend.module, x, sigma, cond), trained, atol=1e-4)
