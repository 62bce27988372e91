"""The LTX-2 family's recipe node: which audio-video model to build, its clip length and frame rate,
and its answers to the validator.

`LTX2ModelConfig(pretrained_path=<dir>)` names a local diffusers LTX-2 directory (an
`LTX2Pipeline`: transformer/ (LTX2VideoTransformer3DModel), vae/ (AutoencoderKLLTX2Video),
audio_vae/ (AutoencoderKLLTX2Audio), vocoder/, connectors/, text_encoder/ (Gemma 3) and tokenizer/,
scheduler/); `LTX2ModelConfig(tiny=TinyLTX2Config(...))` a tiny random one built from configs,
offline. Every sample is a clip of `num_frames` frames at `frame_rate` with its soundtrack of the
same duration.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any, ClassVar

from unirl.models.flow.config import (
    FamilySpec,
    FlowFamilyConfig,
    TinyFlowConfig,
    clip_size_problems,
    read_vae_config,
)
from unirl.types.constraints import AtLeastOne, Positive, check_fields

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
"""LTX-2's attention projections, as peft name suffixes: every attention of its blocks (video and
audio self-attention, their text cross-attention, and the audio-to-video and video-to-audio
cross-attention) is named alike, so one list trains both streams; add "ff.net.0.proj" and
"ff.net.2" (and "audio_ff.net.0.proj", "audio_ff.net.2") for the feed-forwards."""


@dataclass
class TinyLTX2Config(TinyFlowConfig):
    """A tiny LTX-2-architecture audio-video model for CPU runs and tests (random weights).

    `resolution` is the frame side in pixels the model is built for. A small random
    `AutoencoderKLLTX2Video` (one level `vae_width` channels wide) compresses 2x along each side
    and 2x along time into `latent_channels` channels; a small random `AutoencoderKLLTX2Audio`
    encodes `mel_bins`-bin mel spectrograms (4x along time and along the bins) into
    `audio_latent_channels` channels, and a small `LTX2Vocoder` turns mel spectrograms into
    `audio_channels`-channel waveforms at 16 kHz. The transformer (`num_layers` blocks of a video
    stream `num_attention_heads` x `attention_head_dim` wide and an audio stream
    `audio_num_attention_heads` x `audio_attention_head_dim` wide) takes each latent cell as a
    token (patch 1, as the real one). The prompt encoder is a tiny Gemma 3 text model
    (`text_hidden_size` wide, `text_layers` deep; the pipeline stacks all its hidden states)
    followed by LTX-2's text connectors, over a byte-level BPE tokenizer where `words` are whole
    tokens.

    `perturbed_attn` builds the blocks with LTX-2.x's perturbable self-attention (the transformer
    config's `perturbed_attn`), which spatio-temporal guidance needs (`LTX2ModelConfig.stg_scale`).

    The audio latent tokens must be as wide as the video's (`audio_latent_channels` x `mel_bins`
    / 4 == `latent_channels`, as in the real model's 8 x 16 == 128): the stage samples one latent
    [C, video tokens + audio tokens].
    """

    resolution: AtLeastOne = 16
    num_layers: AtLeastOne = 1
    num_attention_heads: AtLeastOne = 2
    attention_head_dim: AtLeastOne = 8
    audio_num_attention_heads: AtLeastOne = 2
    audio_attention_head_dim: AtLeastOne = 4
    text_hidden_size: AtLeastOne = 16
    text_layers: AtLeastOne = 2
    audio_latent_channels: AtLeastOne = 2
    mel_bins: AtLeastOne = 8
    audio_channels: AtLeastOne = 2
    vae_width: AtLeastOne = 8
    perturbed_attn: bool = False

    def __post_init__(self) -> None:
        self.words = list(self.words)
        check_fields(self, "model.tiny.")
        if self.mel_bins % 4:
            raise ValueError(
                f"model.tiny.mel_bins must be a multiple of 4 (the audio VAE compresses the bins 4x), got {self.mel_bins}"
            )
        if self.audio_latent_channels * (self.mel_bins // 4) != self.latent_channels:
            raise ValueError(
                f"model.tiny.audio_latent_channels x model.tiny.mel_bins / 4 = "
                f"{self.audio_latent_channels} x {self.mel_bins // 4} must equal model.tiny.latent_channels="
                f"{self.latent_channels}: an audio latent token is as wide as a video one (the stage samples "
                "both in one latent)"
            )
        if self.text_hidden_size % 2 or self.attention_head_dim % 2 or self.audio_attention_head_dim % 2:
            raise ValueError(
                "model.tiny.text_hidden_size, attention_head_dim and audio_attention_head_dim must be even "
                f"(rotary halves), got {self.text_hidden_size}, {self.attention_head_dim}, "
                f"{self.audio_attention_head_dim}"
            )


@dataclass
class LTX2ModelConfig(FlowFamilyConfig):
    """Which LTX-2 model to build (exactly one of `pretrained_path` / `tiny`), and the clips it
    samples.

    Attributes:
        pretrained_path: local diffusers directory of an LTX-2 (text-to-audio-video) model.
        num_frames: frames per video, 1 + k x the VAE's temporal compression (the real VAE's 8:
            1, 9, ..., 121, the pipeline's default).
        frame_rate: frames per second: the soundtrack lasts num_frames / frame_rate seconds, and
            the transformer's video positions are in seconds (the pipeline's `frame_rate`).
        audio_guidance_scale: the audio stream's classifier-free guidance scale (the pipeline's
            `audio_guidance_scale`); null: `sampling.guidance_scale`, as the pipeline's default
            when it is not given.
        stg_scale, audio_stg_scale: spatio-temporal guidance (the pipeline's `stg_scale`,
            `audio_stg_scale`): one more forward of the cond branch with the self-attention of
            the `stg_blocks` transformer blocks perturbed, its x0 pushed away from by that scale;
            0: off. The audio's null: the video's.
        stg_blocks: the transformer block indices STG perturbs (the pipeline's
            `spatio_temporal_guidance_blocks`: its default [28]; its docs recommend [29] for LTX-2.0
            and [28] for LTX-2.3).
        modality_scale, audio_modality_scale: modality-isolation guidance (one more forward of the
            cond branch with the audio-video cross-attention off, pushed away from by scale - 1);
            1: off. The audio's null: the video's.
        guidance_rescale, audio_guidance_rescale: the guided x0 rescaled toward the cond x0's
            standard deviation, per stream (`rescale_noise_cfg`); 0: off. The audio's null: the
            video's. (The pipeline reads an audio value of 0 as unset too; here 0 is 0.)

    The pipeline's defaults guide with all of them (STG 1.0 at block 28, modality 3.0, rescale 0.7,
    audio CFG 7.0); the defaults here are all off, so that a recipe states the forwards it pays
    for (each of STG and modality guidance is one more forward per step).
    """

    SPEC: ClassVar[FamilySpec] = FamilySpec(
        name="LTX-2", bundle="unirl.models.ltx2.bundle.LTX2Bundle", transformer="LTX2VideoTransformer3DModel",
        pipeline="LTX2Pipeline",
    )  # fmt: skip

    tiny: TinyLTX2Config | None = field(default_factory=TinyLTX2Config)
    num_frames: AtLeastOne = 121
    frame_rate: Positive = 24.0
    audio_guidance_scale: float | None = None
    stg_scale: float = 0.0
    audio_stg_scale: float | None = None
    stg_blocks: list[int] = field(default_factory=list)
    modality_scale: float = 1.0
    audio_modality_scale: float | None = None
    guidance_rescale: float = 0.0
    audio_guidance_rescale: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        problems = [
            f"model.{key} must be >= {low}{' or null' if nullable else ''}{hint}, got {value}"
            for key, low, hint, nullable in (
                ("audio_guidance_scale", 1, " (1: no guidance)", True),
                ("stg_scale", 0, " (0: off)", False),
                ("audio_stg_scale", 0, " (0: off)", True),
                ("modality_scale", 1, " (1: off)", False),
                ("audio_modality_scale", 1, " (1: off)", True),
                ("guidance_rescale", 0, " and <= 1 (0: off)", False),
                ("audio_guidance_rescale", 0, " and <= 1 (0: off)", True),
            )
            if (value := getattr(self, key)) is not None and (value < low or ("rescale" in key and value > 1))
        ]
        if problems:
            raise ValueError("; ".join(problems))
        self.stg_blocks = [int(b) for b in self.stg_blocks]
        if self.stg_on() and not self.stg_blocks:
            raise ValueError(
                f"model.stg_scale={self.stg_scale} / audio_stg_scale={self.audio_stg_scale} turn spatio-temporal "
                "guidance on but model.stg_blocks is empty: name the blocks it perturbs, e.g. [28] (the pipeline's default)"
            )
        tiny = self.tiny if self.tiny is not None and not self.pretrained_path else None
        layers = tiny.num_layers if tiny is not None else None
        bad = [b for b in self.stg_blocks if b < 0 or (layers is not None and b >= layers)]
        if bad:
            raise ValueError(
                f"model.stg_blocks={self.stg_blocks}: {bad} outside the transformer's blocks "
                f"0..{'num_layers - 1' if layers is None else layers - 1}"
            )
        if tiny is not None and self.stg_on() and not tiny.perturbed_attn:
            raise ValueError(
                f"model.stg_scale={self.stg_scale} / audio_stg_scale={self.audio_stg_scale}: the tiny transformer is "
                "built without perturbable self-attention, so STG would change nothing; set "
                "model.tiny.perturbed_attn=true, or model.stg_scale=0"
            )

    def stg_on(self) -> bool:
        return self.stg_scale > 0 or (self.audio_stg_scale or 0) > 0

    def bundle_options(self) -> dict[str, Any]:
        return {
            "num_frames": self.num_frames,
            "frame_rate": self.frame_rate,
            "audio_guidance_scale": self.audio_guidance_scale,
            "extra_guidance": {
                "stg_scale": self.stg_scale,
                "audio_stg_scale": self.audio_stg_scale,
                "stg_blocks": list(self.stg_blocks) if self.stg_on() else [],
                "modality_scale": self.modality_scale,
                "audio_modality_scale": self.audio_modality_scale,
                "guidance_rescale": self.guidance_rescale,
                "audio_guidance_rescale": self.audio_guidance_rescale,
            },
        }

    def size_problems(self, height: int, width: int, key: str = "sampling") -> list[str]:
        """Sides multiples of the VAE's spatial scale (the transformer's patch is 1: one token per
        latent cell; 32 px with the real VAE), `model.num_frames` = 1 + k x its temporal scale, and
        a clip that lasts at least one audio latent frame."""
        problems = clip_size_problems(height, width, self.num_frames, self.scales(), "the LTX-2 VAE", key)
        per_second = self.audio_frames_per_second()
        if per_second is not None and round(self.num_frames / self.frame_rate * per_second) < 1:
            problems.append(
                f"model.num_frames={self.num_frames} at model.frame_rate={self.frame_rate} lasts "
                f"{self.num_frames / self.frame_rate:.3f} s, shorter than one audio latent frame "
                f"({1 / per_second:.3f} s): give more frames or a lower frame rate"
            )
        return problems

    def audio_frames_per_second(self) -> float | None:
        """Audio latent frames per second: the audio VAE's sample rate / mel hop / its 4x temporal
        compression (the tiny one's 16000 / 160 / 4 = 25; a directory's audio_vae/config.json);
        None when unreadable (the load reports it)."""
        if not self.pretrained_path:
            return 16000 / 160 / 4
        try:
            with open(os.path.join(self.pretrained_path, "audio_vae", "config.json")) as f:
                audio = json.load(f)
            return float(audio.get("sample_rate", 16000)) / float(audio.get("mel_hop_length", 160)) / 4
        except (OSError, ValueError, TypeError, ZeroDivisionError):
            return None

    def guidance_problems(self, guidance_scale: float, key: str) -> list[str]:
        """Classifier-free guidance at any scale >= 1 (1: none); an audio scale > 1 only beside a
        guided video (the stage encodes the uncond prompt for the video's scale; the pipeline would
        guide both streams)."""
        audio = self.audio_guidance_scale
        if audio is not None and audio > 1.0 and guidance_scale <= 1.0:
            return [
                f"model.audio_guidance_scale={audio} needs {key} > 1 (got {guidance_scale}): UniRL guides LTX-2 "
                f"when the video is guided; set {key} > 1 or model.audio_guidance_scale to null or 1"
            ]
        return []

    def directory_problems(self) -> list[str]:
        """The family directory's checks, and with STG on, a transformer that can run it: its
        config's `perturbed_attn` true and `model.stg_blocks` among its `num_layers` blocks."""
        problems = super().directory_problems()
        if problems or not self.pretrained_path or not self.stg_on():
            return problems
        path = os.path.join(self.pretrained_path, "transformer", "config.json")
        try:
            with open(path) as f:
                transformer = json.load(f)
        except (OSError, ValueError) as exc:
            return [f"model.pretrained_path: cannot read {path} ({exc})"]
        if not transformer.get("perturbed_attn", False):
            problems.append(
                f"model.stg_scale={self.stg_scale} / audio_stg_scale={self.audio_stg_scale}: {path} has no "
                "perturbed_attn: true (its blocks cannot be perturbed), so STG would change nothing; set "
                "model.stg_scale=0 (and audio_stg_scale 0 or null) for this transformer"
            )
        layers = int(transformer.get("num_layers", 0))
        if any(b >= layers for b in self.stg_blocks):
            problems.append(f"model.stg_blocks={self.stg_blocks}: {path} has blocks 0..{layers - 1}")
        return problems

    def scales(self) -> tuple[int, int] | None:
        """(temporal, spatial) compression, from the tiny config (2, 2) or the directory's
        vae/config.json; None when unreadable (reported by the load)."""
        if not self.pretrained_path:
            return 2, 2
        try:
            vae = read_vae_config(self.pretrained_path)
            if vae is None:
                return None
            scaling = vae.get("spatio_temporal_scaling", (True, True, True, True))
            levels = (
                sum(bool(s) for s in scaling) if isinstance(scaling, (list, tuple)) else 4 * bool(scaling)
            )
            spatial = vae.get("spatial_compression_ratio") or vae.get("patch_size", 4) * 2**levels
            temporal = vae.get("temporal_compression_ratio") or vae.get("patch_size_t", 1) * 2**levels
            return int(temporal), int(spatial)
        except (OSError, KeyError, ValueError, TypeError):
            return None
