"""The tiny LTX-2 Flow-GRPO recipe in this process: two steps at a test's size (4 denoising steps,
2 of them SDE), on-policy first ratio 1, both streams scored (the video's redness, the
soundtrack's tone) and the soundtracks saved beside the frames; a LoRA that `LTX2Pipeline`
loads and that changes its video and its audio; the real-size recipe validates against a saved
directory."""

from __future__ import annotations

import math
import wave

import torch
from diffusers import LTX2Pipeline

from tests.recipes import IN_PROCESS, composed, run
from unirl.config.validate import validate_recipe
from unirl.models.ltx2 import LTX2ModelConfig

SMALL = [
    "num_steps=2", "threads_per_worker=1", "prompts_per_rollout=2", "sampling.samples_per_prompt=2",
    "sampling.num_steps=4", "sampling.sde_num_steps=2", "train.stack.micro_batch_size=4",
    "logging.progress=false", "logging.save_images_every=2",
]  # fmt: skip


def test_tiny_ltx2_flowgrpo_trains_on_video_and_audio_and_its_lora_loads(tmp_path) -> None:
    rows = run("diffusion/tiny_ltx2_flowgrpo", tmp_path, *IN_PROCESS, *SMALL)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(r["ratio/first_update_mean"] == 1.0 and math.isfinite(r["reward/mean"]) for r in rows)
    assert all(0 < r["reward/tone/mean"] < 1 and 0 < r["reward/redness/mean"] < 1 for r in rows)
    with wave.open(str(tmp_path / "samples" / "step_0002_3.wav")) as f:
        assert (f.getnchannels(), f.getframerate(), f.getsampwidth()) == (2, 16000, 2) and f.getnframes() > 0
    pipe = LTX2Pipeline.from_pretrained(tmp_path / "base_model")
    pipe.set_progress_bar_config(disable=True)

    def clip():
        out = pipe(
            prompt="a red circle", height=32, width=32, num_frames=5, frame_rate=25.0, num_inference_steps=2,
            guidance_scale=1.0, stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_guidance_scale=1.0,
            audio_stg_scale=0.0, audio_modality_scale=1.0, audio_guidance_rescale=0.0,
            spatio_temporal_guidance_blocks=None, output_type="pt", generator=torch.Generator().manual_seed(0),
        )  # fmt: skip
        return out.frames, out.audio

    frames, audio = clip()
    pipe.load_lora_weights(tmp_path / "checkpoints" / "final")
    lora_frames, lora_audio = clip()
    assert (lora_frames - frames).abs().max().item() > 0 and (lora_audio - audio).abs().max().item() > 0


def test_every_guidance_term_of_the_pipeline_trains_on_policy(tmp_path) -> None:
    """Spatio-temporal guidance, modality guidance and the guidance rescale in the rollout are in
    the replay too: the first update's ratio is exactly 1 and the step trains."""
    terms = [
        "++model.tiny.perturbed_attn=true", "++model.stg_scale=1.0", "++model.stg_blocks=[0]",
        "++model.modality_scale=2.0", "++model.guidance_rescale=0.5", "logging.save_images_every=0",
    ]  # fmt: skip
    rows = run("diffusion/tiny_ltx2_flowgrpo", tmp_path, *IN_PROCESS, *SMALL, "num_steps=1", *terms)
    assert rows[0]["ratio/first_update_mean"] == 1.0 and rows[0]["train/grad_norm"] > 0


NFT = [
    "algorithm._target_=unirl.algorithms.diffusion_nft.DiffusionNFT",
    "algorithm.config._target_=unirl.algorithms.diffusion_nft.DiffusionNFTConfig",
    "~algorithm.config.clip_range", "~algorithm.config.clip_schedule", "~algorithm.config.beta",
    "~algorithm.config.old_logp_source", "sampling.eta=0.0", "sampling.sde_scheduler=all",
]  # fmt: skip


def test_diffusion_nft_trains_on_the_joint_latent(tmp_path) -> None:
    """A forward-process algorithm noises the clip's final latent, video and audio tokens alike, and
    trains the velocity on both (`scripts/family_algorithms.py ltx2` runs every algorithm)."""
    rows = run("diffusion/tiny_ltx2_flowgrpo", tmp_path, *IN_PROCESS, *SMALL, *NFT)
    assert [r["step"] for r in rows] == [1, 2]
    assert all(math.isfinite(r["loss"]) and 0 < r["reward/tone/mean"] < 1 for r in rows)


def test_real_size_recipe_validates_against_a_directory(tmp_path, monkeypatch) -> None:
    directory = tmp_path / "ltx2"
    LTX2ModelConfig(tiny={"resolution": 32}, num_frames=9).build().save_pretrained(str(directory))
    monkeypatch.setenv("PRETRAINED_MODEL", str(directory))
    validate_recipe(composed("diffusion/ltx2_flowgrpo", tmp_path / "out"), expect="diffusion")
