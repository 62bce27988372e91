"""The HunyuanVideo 1.5 family's recipe node: which model to build, its clip length, and its answers
to the validator.

`HunyuanVideo15ModelConfig(pretrained_path=<dir>)` names a local diffusers HunyuanVideo 1.5 T2V
directory (a `HunyuanVideo15Pipeline`: transformer/ (HunyuanVideo15Transformer3DModel), vae/
(AutoencoderKLHunyuanVideo15), text_encoder/ (a Qwen2.5-VL text model) and tokenizer/,
text_encoder_2/ (ByT5) and tokenizer_2/, scheduler/, guider/);
`HunyuanVideo15ModelConfig(tiny=TinyHunyuanVideo15Config(...))` a tiny random one built from
configs, offline. `num_frames` is the clip length every sample has (a latent sample is
[C, f, h, w], f = (num_frames - 1) / temporal + 1).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from unirl.models.flow.config import (
    ConditionedFamilyConfig,
    FamilySpec,
    FlowFamilyConfig,
    TinyFlowConfig,
    check_video_vae_scales,
    clip_size_problems,
    read_vae_config,
)
from unirl.types.constraints import AtLeastOne, check_fields

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
"""HunyuanVideo 1.5's attention projections, as peft name suffixes: the video and text streams of
its dual-stream blocks (the text token refiner's attention is named alike and trains too; add
"ff.net.0.proj" and "ff.net.2" for the feed-forwards)."""


@dataclass
class TinyHunyuanVideo15Config(TinyFlowConfig):
    """A tiny HunyuanVideo 1.5-architecture video model for CPU runs and tests (random weights).

    `resolution` is the frame side in pixels the model is built for. A small random
    `AutoencoderKLHunyuanVideo15` (causal 3D convolutions, widths `vae_widths`) compresses
    `vae_spatial`x along each side and `vae_temporal`x along time (the first frame alone, then
    groups) into `latent_channels` channels; the transformer (`num_layers` dual-stream blocks,
    `num_attention_heads` x `attention_head_dim`, a `num_refiner_layers`-deep text token refiner)
    takes each latent cell as a token (patch 1, as the real one), with rotary axes
    `rope_axes_dim` (frames, rows, columns: even sizes summing to the head dim). The prompt encoder
    is a tiny Qwen2.5-VL text model (`text_hidden_size` wide, `text_layers` deep; the pipeline reads
    its third-to-last hidden states, so at least 2) over a byte-level BPE tokenizer with Qwen2's
    pre-tokenization and ChatML template where the system message's words are whole tokens (its
    prefix is then the 108 tokens the pipeline crops, as with the real tokenizer); the glyph encoder
    a tiny ByT5 (`byt5_hidden_size` wide). The image-condition width `image_embed_dim` only sizes
    the (all-zero, text-to-video) image stream.
    """

    resolution: AtLeastOne = 16
    num_layers: AtLeastOne = 1
    num_refiner_layers: AtLeastOne = 1
    num_attention_heads: AtLeastOne = 2
    attention_head_dim: AtLeastOne = 16
    rope_axes_dim: list[int] = field(default_factory=lambda: [4, 6, 6])
    text_hidden_size: AtLeastOne = 16
    text_layers: AtLeastOne = 2
    byt5_hidden_size: AtLeastOne = 16
    image_embed_dim: AtLeastOne = 8
    vae_spatial: int = 2
    vae_temporal: int = 2
    vae_widths: list[int] = field(default_factory=lambda: [8, 16])

    def __post_init__(self) -> None:
        self.rope_axes_dim = list(self.rope_axes_dim)
        self.words = list(self.words)
        self.vae_widths = list(self.vae_widths)
        check_fields(self, "model.tiny.")
        dims = self.rope_axes_dim
        if len(dims) != 3 or sum(dims) != self.attention_head_dim or any(d % 2 for d in dims):
            raise ValueError(
                f"model.tiny.rope_axes_dim={dims} must be 3 even sizes summing to "
                f"model.tiny.attention_head_dim={self.attention_head_dim} (frames, rows, columns)"
            )
        if self.text_layers < 2:
            raise ValueError(
                "model.tiny.text_layers must be >= 2: HunyuanVideo 1.5 reads the prompt encoder's "
                f"third-to-last hidden states, got {self.text_layers}"
            )
        if self.text_hidden_size % 2 or self.byt5_hidden_size % 2:
            raise ValueError(
                "model.tiny.text_hidden_size and model.tiny.byt5_hidden_size must be even (2 heads), got "
                f"{self.text_hidden_size} and {self.byt5_hidden_size}"
            )
        for i, width in enumerate(self.vae_widths):
            if not isinstance(width, int) or width < 1:
                raise ValueError(f"model.tiny.vae_widths[{i}] must be an integer >= 1, got {width!r}")
        check_video_vae_scales(self.vae_spatial, self.vae_temporal)
        downsamples = self.vae_spatial.bit_length() - 1
        if len(self.vae_widths) <= downsamples:
            raise ValueError(
                f"model.tiny.vae_widths={self.vae_widths} needs more than {downsamples} levels: the VAE "
                f"downsamples once per level for model.tiny.vae_spatial={self.vae_spatial}"
            )

    @property
    def scales(self) -> tuple[int, int]:
        """(temporal, spatial) compression of the latents."""
        return self.vae_temporal, self.vae_spatial


@dataclass
class HunyuanVideo15ModelConfig(FlowFamilyConfig):
    """Which HunyuanVideo 1.5 T2V model to build (exactly one of `pretrained_path` / `tiny`), and
    the clip length it samples.

    Attributes:
        pretrained_path: local diffusers directory of a HunyuanVideo 1.5 T2V model.
        num_frames: frames per video, 1 + k x the VAE's temporal compression (the real VAE's 4:
            1, 5, ..., 121).
    """

    SPEC: ClassVar[FamilySpec] = FamilySpec(
        name="HunyuanVideo 1.5 T2V", bundle="unirl.models.hunyuanvideo.bundle.HunyuanVideo15Bundle",
        transformer="HunyuanVideo15Transformer3DModel", pipeline="HunyuanVideo15Pipeline",
    )  # fmt: skip

    tiny: TinyHunyuanVideo15Config | None = field(default_factory=TinyHunyuanVideo15Config)
    num_frames: AtLeastOne = 121

    def bundle_options(self) -> dict[str, Any]:
        return {"num_frames": self.num_frames}

    def size_problems(self, height: int, width: int, key: str = "sampling") -> list[str]:
        """Sides multiples of the VAE's spatial scale (the transformer's patch is 1: one token per
        latent cell; 16 px with the real VAE), and `model.num_frames` = 1 + k x its temporal scale."""
        return clip_size_problems(
            height, width, self.num_frames, self.scales(), "the HunyuanVideo 1.5 VAE", key
        )

    def guidance_problems(self, guidance_scale: float, key: str) -> list[str]:
        """Classifier-free guidance at any scale >= 1 (1: none)."""
        return []

    def directory_problems(self) -> list[str]:
        """The family's directory check, and a guider the stage reproduces: plain classifier-free
        guidance over every step (no `guidance_rescale`, no `start` / `stop` window)."""
        problems = super().directory_problems()
        if problems or not self.pretrained_path:
            return problems
        path = os.path.join(self.pretrained_path, "guider", "guider_config.json")
        try:
            with open(path) as f:
                guider = json.load(f)
        except (OSError, ValueError):
            return problems
        extra = {
            k: guider[k]
            for k, plain in (
                ("guidance_rescale", 0.0),
                ("start", 0.0),
                ("stop", 1.0),
                ("use_original_formulation", False),
            )
            if k in guider and guider[k] != plain
        }
        if extra:
            problems.append(
                f"model.pretrained_path: {path} sets {extra}: UniRL's stage guides every step by plain "
                "classifier-free guidance at sampling.guidance_scale; remove them or add that guidance"
            )
        return problems

    def scales(self) -> tuple[int, int] | None:
        """(temporal, spatial) compression, from the tiny config or the directory's vae/config.json;
        None when unreadable (reported by the load)."""
        if not self.pretrained_path:
            return self.tiny.scales
        try:
            vae = read_vae_config(self.pretrained_path)
            if vae is None:
                return None
            return int(vae.get("temporal_compression_ratio", 4)), int(
                vae.get("spatial_compression_ratio", 16)
            )
        except (OSError, KeyError, ValueError, TypeError):
            return None


@dataclass
class HunyuanVideo15I2VModelConfig(ConditionedFamilyConfig, HunyuanVideo15ModelConfig):
    """Which HunyuanVideo 1.5 image-to-video model to build (`HunyuanVideo15ImageToVideoPipeline`:
    the T2V modules plus a SigLIP `image_encoder/` and `feature_extractor/`), or a tiny one (the
    T2V tiny model with a one-layer random SigLIP). Each prompt row names its first frame under
    `condition_key` (`condition_problems`; a data source resolves that key's relative paths when
    it is in its `path_keys`); the frame is resized to the sampled size (`unirl.models.hunyuanvideo.i2v`)."""

    SPEC: ClassVar[FamilySpec] = replace(
        HunyuanVideo15ModelConfig.SPEC, name="HunyuanVideo 1.5 I2V",
        bundle="unirl.models.hunyuanvideo.i2v.HunyuanVideo15I2VBundle",
        pipeline="HunyuanVideo15ImageToVideoPipeline",
    )  # fmt: skip
    condition_key: str = "images"

    def condition_problems(self, examples: list, where: str, sampling: Any = None) -> list[str]:
        """Every prompt row of `where` (its examples) names exactly one first frame that reads;
        problems name the row."""
        from unirl.models.images import row_images

        problems: list[str] = []
        need = "HunyuanVideo 1.5 image-to-video starts from exactly one first frame"
        row_images(examples, self.condition_key, where, problems, "image(s)", need, True)
        return problems
