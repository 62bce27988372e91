"""The FLUX.1 family's recipe node: which model to build, and its answers to the validator.

`FluxModelConfig(pretrained_path=<dir>)` names a local diffusers FLUX.1 directory (a
`FluxPipeline`: transformer/, vae/, text_encoder/ (CLIP), text_encoder_2/ (T5), their
tokenizers, scheduler/); `FluxModelConfig(tiny=TinyFluxConfig(...))` a tiny random one built
from configs, offline.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import ClassVar

from unirl.models.flow.config import (
    FamilySpec,
    FlowFamilyConfig,
    PackedTinyConfig,
    cell_size_problems,
    read_vae_config,
)
from unirl.types.constraints import AtLeastOne, NonNegativeInt, check_fields

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
"""FLUX.1's attention projections, as peft name suffixes: the image and text streams of the
double-stream blocks (`to_*`, `add_*`, `to_add_out`) and the q/k/v of the single-stream blocks
(whose output projection `proj_out` also mixes the MLP; add "proj_mlp" and "proj_out" to train
those too)."""


@dataclass
class TinyFluxConfig(PackedTinyConfig):
    """A tiny FLUX.1-architecture model for CPU runs and tests (random weights).

    `resolution` is the image side in pixels the model is built for (FLUX's rotary position
    embedding takes any size; `sample_size` reports this one). In pixel space the transformer
    denoises RGB in [-1, 1] packed 2x2 (12 channels per token); otherwise a small random
    AutoencoderKL with FLUX's latent scaling and shift (`vae_scaling_factor`,
    `vae_shift_factor`) and a `vae_downsample`x downsample gives `latent_channels` latents,
    packed 2x2. `axes_dims_rope` must sum to `attention_head_dim`. `guidance_embeds` makes it a
    guidance-distilled model (FLUX.1-dev: the scale is a network input); without it (like
    FLUX.1-schnell) it takes no guidance at all. `words` become whole-word tokens of the tiny
    CLIP and T5 tokenizers.
    """

    resolution: AtLeastOne = 32
    pixel_space: bool = True
    num_layers: AtLeastOne = 1
    num_single_layers: NonNegativeInt = 1
    attention_head_dim: AtLeastOne = 16
    num_attention_heads: AtLeastOne = 2
    axes_dims_rope: list[int] = field(default_factory=lambda: [4, 6, 6])
    guidance_embeds: bool = True
    clip_hidden_size: AtLeastOne = 32
    t5_hidden_size: AtLeastOne = 32
    text_layers: AtLeastOne = 1
    clip_max_length: AtLeastOne = 77
    vae_downsample: int = 2
    vae_scaling_factor: float = 0.3611
    vae_shift_factor: float = 0.1159

    def __post_init__(self) -> None:
        self.axes_dims_rope = list(self.axes_dims_rope)
        check_fields(self, "model.tiny.")
        self.check_packed_geometry()
        if self.clip_hidden_size % 2:
            raise ValueError(
                f"model.tiny.clip_hidden_size must be even (2 CLIP heads), got {self.clip_hidden_size}"
            )


@dataclass
class FluxModelConfig(FlowFamilyConfig):
    """Which FLUX.1 model to build (exactly one of `pretrained_path` / `tiny`).

    Attributes:
        pretrained_path: local diffusers directory of a FLUX.1 model (`FluxPipeline`).
    """

    SPEC: ClassVar[FamilySpec] = FamilySpec(
        name="FLUX.1", bundle="unirl.models.flux.bundle.FluxBundle", transformer="FluxTransformer2DModel",
        pipeline="FluxPipeline",
    )  # fmt: skip

    tiny: TinyFluxConfig | None = field(default_factory=TinyFluxConfig)

    def size_problems(self, height: int, width: int, key: str = "sampling") -> list[str]:
        """height and width must be multiples of vae_scale_factor * 2 (the VAE's downsample times
        the 2x2 packing: 16 px with FLUX's VAE); the messages name `{key}.height` / `{key}.width`."""
        cell = self._read("cell")
        if cell is None:
            return []
        return cell_size_problems(height, width, cell, "FLUX packs", key)

    def guidance_problems(self, guidance_scale: float, key: str) -> list[str]:
        """A guidance-distilled model (guidance_embeds) takes any scale >= 1 as a network input;
        one without (like FLUX.1-schnell) takes none, and this family runs no true CFG, so the
        scale must be 1.0."""
        embeds = self._read("guidance_embeds")
        if embeds is None or embeds or guidance_scale == 1.0:
            return []
        return [
            f"{key}={guidance_scale}: this FLUX model has no guidance embedding (transformer "
            "guidance_embeds false, like FLUX.1-schnell) and the FLUX family runs no true "
            f"classifier-free guidance; set {key}: 1.0"
        ]

    def _read(self, what: str) -> int | bool | None:
        """`cell` (pixels per packed token along a side) or `guidance_embeds`, from the tiny
        config or the directory's configs; None when unreadable (reported by the load)."""
        if not self.pretrained_path:
            return 2 * self.tiny.vae_scale_factor if what == "cell" else self.tiny.guidance_embeds
        try:
            if what == "guidance_embeds":
                with open(os.path.join(self.pretrained_path, "transformer", "config.json")) as f:
                    return bool(json.load(f).get("guidance_embeds", False))
            vae = read_vae_config(self.pretrained_path)
            if vae is None:
                return 2  # pixel space: the 2x2 packing of pixels
            return 2 * 2 ** (len(vae["block_out_channels"]) - 1)
        except (OSError, KeyError, ValueError):
            return None
