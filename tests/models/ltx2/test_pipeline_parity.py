"""LTX-2: ODE sampling through the shared stage equals diffusers' `LTX2Pipeline` on a tiny model,
video and audio together.

Same tiny weights (a random audio-video transformer, a tiny video VAE, a tiny audio VAE and
vocoder, a tiny Gemma 3 text model and the text connectors), prompts, x_T and schedule: the
pipeline computes its own schedule (`linspace(1, 1/T, T)`, its scheduler's static shift 1), both
streams' text tokens through the connectors, and its classifier-free guidance in x0 form
(`guidance_scale` on the video, `audio_guidance_scale` on the audio; spatio-temporal guidance,
modality guidance and guidance rescale off, as the recipe sets them). The stage's one latent
[C, video tokens + audio tokens] is split into the pipeline's packed `latents` and
`audio_latents` (3-D, which the pipeline takes as they are: the tiny audio VAE's latents mean /
std are 0 / 1, so its normalization of given audio latents is the identity). The pipeline needs
sides that are multiples of 32.
"""

from __future__ import annotations

import pytest
import torch
from diffusers import LTX2Pipeline

from tests.models.lora import trained_lora_backend
from unirl.models.ltx2 import LORA_TARGETS, LTX2ModelConfig, LTX2Stage
from unirl.sde.schedules import sigmas_for
from unirl.train.backend import lora_target_problem
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

PROMPTS = ["a red square", "a low tone"]
SIZE, FRAMES, RATE, LENGTH = 32, 5, 25.0, 8
OFF = dict(
    stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_stg_scale=0.0, audio_modality_scale=1.0,
    audio_guidance_rescale=0.0, spatio_temporal_guidance_blocks=None,
)  # fmt: skip


def tiny_config(perturbed_attn: bool = False, **options) -> LTX2ModelConfig:
    words = ["a", "red", "square", "low", "tone"]
    return LTX2ModelConfig(
        tiny={"resolution": SIZE, "words": words, "perturbed_attn": perturbed_attn},
        num_frames=FRAMES,
        frame_rate=RATE,
        **options,
    )


@pytest.fixture(scope="module")
def bundle():
    return tiny_config(audio_guidance_scale=5.0).build()


def sample(bundle, prompts, guidance: float, num_steps: int, output_type: str, terms: dict = OFF):
    """(the stage's final latents, x_T, the pipeline's output, the stage); `terms`: the pipeline's
    guidance terms beyond CFG (the bundle's own `extra` must say the same)."""
    sp = DiffusionSamplingParams(
        num_steps=num_steps, samples_per_prompt=1, height=SIZE, width=SIZE, guidance_scale=guidance, eta=0.0,
        shift=1.0, sigma_grid="steps", max_sequence_length=LENGTH,
    )  # fmt: skip
    stage = LTX2Stage(bundle)
    sigmas = sigmas_for(sp, bundle.image_seq_len(SIZE, SIZE))
    req = RolloutReq.from_prompts([PromptExample(p, str(i)) for i, p in enumerate(prompts)], sp, sigmas, 0)
    ours = stage.diffuse(req, stage.encode_request(req)).at(num_steps)
    shape = bundle.latent_shape(SIZE, SIZE)
    x_t = torch.stack(
        [torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in req.init_seeds]
    )
    video, audio = bundle.split(x_t, bundle.image_seq_len(SIZE, SIZE))
    pipe = LTX2Pipeline(**bundle.pipeline.components)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad():
        out = pipe(
            prompt=list(prompts), height=SIZE, width=SIZE, num_frames=FRAMES, frame_rate=RATE,
            num_inference_steps=num_steps, guidance_scale=guidance, audio_guidance_scale=bundle.audio_guidance_scale,
            latents=video, audio_latents=audio, max_sequence_length=LENGTH, output_type=output_type, **terms,
        )  # fmt: skip
    assert torch.equal(pipe.scheduler.sigmas[:-1], sigmas[:-1])
    return ours, x_t, out, stage


@pytest.fixture(scope="module")
def unguided():
    return tiny_config().build()


@pytest.mark.parametrize(("guidance", "num_steps"), [(3.0, 3), (1.0, 2)])
def test_ode_sampling_matches_ltx2_pipeline(bundle, unguided, guidance, num_steps) -> None:
    bundle = bundle if guidance > 1 else unguided  # an audio scale > 1 needs a guided video
    ours, x_t, out, _ = sample(bundle, PROMPTS, guidance, num_steps, "latent")
    video, audio = out.frames, out.audio  # [B, C, f, h, w] and [B, C_a, L, M], denormalized
    f, h, w = (FRAMES - 1) // 2 + 1, SIZE // 2, SIZE // 2
    assert ours.shape == (2, 4, f * h * w + bundle.audio_frames) and bundle.audio_frames == 5
    assert (ours - x_t).abs().max().item() > 0.1
    ours_video = ours[..., : f * h * w].reshape(2, 4, f, h, w)
    ours_audio = bundle.pipeline._unpack_audio_latents(
        ours[..., f * h * w :].transpose(1, 2), bundle.audio_frames, num_mel_bins=bundle.mel_bins
    )
    assert torch.equal(ours_video, video), (
        f"video: max |stage - pipeline| = {(ours_video - video).abs().max()}"
    )
    assert torch.equal(ours_audio, audio), (
        f"audio: max |stage - pipeline| = {(ours_audio - audio).abs().max()}"
    )


# every guidance term of the pipeline on, each stream at its own scale (STG perturbs the tiny
# transformer's one block); the pipeline's defaults are STG 1.0, modality 3.0, rescale 0.7
TERMS = dict(
    stg_scale=1.0, audio_stg_scale=0.5, modality_scale=3.0, audio_modality_scale=2.0, guidance_rescale=0.7,
    audio_guidance_rescale=0.4,
)  # fmt: skip


@pytest.mark.parametrize(("guidance", "audio"), [(3.0, 5.0), (1.0, None)])
def test_stg_modality_guidance_and_rescale_match_ltx2_pipeline(guidance, audio) -> None:
    """Spatio-temporal guidance, modality-isolation guidance and the guidance rescale, with and
    without classifier-free guidance: the stage's ODE samples equal the pipeline's bit for bit,
    and each term moves them (the same run with it off differs)."""
    bundle = tiny_config(True, audio_guidance_scale=audio, stg_blocks=[0], **TERMS).build()
    terms = {**OFF, **TERMS, "spatio_temporal_guidance_blocks": [0]}
    ours, _, out, _ = sample(bundle, PROMPTS, guidance, 3, "latent", terms)
    f, h, w = (FRAMES - 1) // 2 + 1, SIZE // 2, SIZE // 2
    assert torch.equal(ours[..., : f * h * w].reshape(2, 4, f, h, w), out.frames)
    audio_latents = bundle.pipeline._unpack_audio_latents(
        ours[..., f * h * w :].transpose(1, 2), bundle.audio_frames, num_mel_bins=bundle.mel_bins
    )
    assert torch.equal(audio_latents, out.audio)
    for term in ("stg_scale", "modality_scale", "guidance_rescale"):
        off = {**TERMS, term: OFF[term], "audio_" + term: OFF["audio_" + term]}
        other = tiny_config(True, audio_guidance_scale=audio, stg_blocks=[0], **off).build()
        assert not torch.equal(sample(other, PROMPTS, guidance, 3, "latent", terms)[0], ours), term


def test_decode_matches_the_pipelines_frames_and_waveforms(bundle) -> None:
    ours, _, out, stage = sample(bundle, PROMPTS, 3.0, 2, "pt")
    assert out.frames.shape == (2, FRAMES, 3, SIZE, SIZE)
    assert torch.equal(stage.decode_float(ours), out.frames)
    waves = bundle.audio(ours)
    assert waves.shape[:2] == (2, 2) and torch.equal(waves, out.audio.float())


def test_lora_targets_both_streams_and_export_loads_back(tmp_path) -> None:
    """The attention names train both streams; `LTX2Pipeline.load_lora_weights` reads the export
    and gives the trained velocity on video and audio tokens."""
    config = tiny_config()
    meta = config.trainable_on_meta()
    assert lora_target_problem(meta, LORA_TARGETS + ["ff.net.0.proj", "ff.net.2"]) is None
    names = [n for n, _ in meta.named_modules() if n.endswith("to_q")]
    assert any(".audio_attn1." in n for n in names) and any(".attn1." in n for n in names)
    fresh = config.build()
    fresh.save_pretrained(str(tmp_path / "base"))
    backend = trained_lora_backend(fresh.transformer, LORA_TARGETS, type(fresh).write_weights)
    backend.save_weights(str(tmp_path / "ckpt"), base_model=str(tmp_path / "base"))
    loaded = config.load_checkpoint(str(tmp_path / "ckpt"))
    sp = DiffusionSamplingParams(
        num_steps=2,
        samples_per_prompt=1,
        height=SIZE,
        width=SIZE,
        guidance_scale=1.0,
        max_sequence_length=LENGTH,
    )
    examples = [PromptExample(p, str(i)) for i, p in enumerate(PROMPTS)]
    req = RolloutReq.from_prompts(examples, sp, sigmas_for(sp, 1), 0)
    cond = LTX2Stage(fresh).encode_request(req)
    x = torch.randn(2, *fresh.latent_shape(SIZE, SIZE), generator=torch.Generator().manual_seed(1))
    sigma = torch.tensor([0.3, 0.8])
    with torch.no_grad():
        trained = fresh.predict(backend.module, x, sigma, cond)
        torch.testing.assert_close(
            loaded.predict(loaded.transformer, x, sigma, cond), trained, rtol=0, atol=1e-6
        )
        backend.module.disable_adapters()
        base = fresh.predict(backend.module, x, sigma, cond)
    video = fresh.image_seq_len(SIZE, SIZE)
    assert not torch.allclose(base[..., :video], trained[..., :video], atol=1e-4)
    assert not torch.allclose(base[..., video:], trained[..., video:], atol=1e-4)


def test_bad_configs_are_refused(tmp_path) -> None:
    with pytest.raises(
        ValueError, match=r"audio_latent_channels x model.tiny.mel_bins / 4 = 2 x 4 must equal"
    ):
        LTX2ModelConfig(tiny={"mel_bins": 16})
    with pytest.raises(ValueError, match=r"model.tiny.mel_bins must be a multiple of 4"):
        LTX2ModelConfig(tiny={"mel_bins": 6})
    with pytest.raises(ValueError, match=r"model.audio_guidance_scale must be >= 1"):
        tiny_config(audio_guidance_scale=0.5)
    with pytest.raises(ValueError, match=r"built without perturbable self-attention"):
        tiny_config(stg_scale=1.0, stg_blocks=[0]).build()
    with pytest.raises(ValueError, match=r"model.stg_blocks is empty"):
        tiny_config(stg_scale=1.0)
    with pytest.raises(
        ValueError, match=r"model.stg_blocks=\[1\]: \[1\] outside the transformer's blocks 0..0"
    ):
        tiny_config(stg_scale=1.0, stg_blocks=[1])
    with pytest.raises(
        ValueError,
        match=r"model.modality_scale must be >= 1 \(1: off\), got 0.5; model.guidance_rescale must be >= 0 and "
        r"<= 1 \(0: off\), got 1.5",
    ):
        tiny_config(modality_scale=0.5, guidance_rescale=1.5)
    with pytest.raises(ValueError, match=r"model.frame_rate"):
        LTX2ModelConfig(frame_rate=0.0)
    assert tiny_config().size_problems(32, 33) == [
        "sampling.width=33 must be a multiple of 2 (the LTX-2 VAE's spatial compression: one token per latent "
        "cell), e.g. 32 or 34"
    ]
    assert any("model.num_frames=6" in p for p in LTX2ModelConfig(num_frames=6).size_problems(32, 32))
    assert tiny_config(audio_guidance_scale=4.0).guidance_problems(1.0, "sampling.guidance_scale") == [
        "model.audio_guidance_scale=4.0 needs sampling.guidance_scale > 1 (got 1.0): UniRL guides LTX-2 when the "
        "video is guided; set sampling.guidance_scale > 1 or model.audio_guidance_scale to null or 1"
    ]
    short = LTX2ModelConfig(tiny={}, num_frames=1, frame_rate=1000.0)
    assert short.size_problems(32, 32) == [
        "model.num_frames=1 at model.frame_rate=1000.0 lasts 0.001 s, shorter than one audio latent frame "
        "(0.040 s): give more frames or a lower frame rate"
    ]
    with pytest.raises(ValueError, match=r"shorter than one audio latent frame"):
        short.build()
    directory = tmp_path / "ltx2"
    tiny_config().build().save_pretrained(str(directory))
    on_disk = LTX2ModelConfig(pretrained_path=str(directory), tiny=None, num_frames=5)
    assert on_disk.directory_problems() == [] and on_disk.size_problems(32, 32) == []
    stg = LTX2ModelConfig(
        pretrained_path=str(directory), tiny=None, num_frames=5, stg_scale=1.0, stg_blocks=[0, 3]
    )
    transformer = directory / "transformer" / "config.json"
    assert stg.directory_problems() == [
        f"model.stg_scale=1.0 / audio_stg_scale=None: {transformer} has no perturbed_attn: true (its blocks cannot "
        "be perturbed), so STG would change nothing; set model.stg_scale=0 (and audio_stg_scale 0 or null) for this "
        "transformer",
        f"model.stg_blocks=[0, 3]: {transformer} has blocks 0..0",
    ]
    (directory / "model_index.json").write_text('{"_class_name": "WanPipeline"}')
    assert "LTX2Pipeline" in "".join(on_disk.directory_problems())
