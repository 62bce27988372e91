"""The SD3 family's recipe node: which model to build, and its answers to the validator.

`SD3ModelConfig(pretrained_path=<dir>)` names a local diffusers SD3 / SD3.5 directory
(transformer/, vae/, text_encoder{,_2,_3}/, tokenizer{,_2,_3}/); `SD3ModelConfig(tiny=TinySD3Config(...))`
a tiny random one built from configs, offline (`pixel_space=True` drops the VAE: the transformer
denoises RGB pixels in [-1, 1] directly, so image rewards respond to the policy). The bundle is
`unirl.models.sd3.bundle.SD3Bundle`, named by `SD3ModelConfig.MODELING`, not imported here.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import ClassVar

from unirl.models.flow.config import FamilySpec, FlowFamilyConfig, TinyFlowConfig, check_vae_downsample
from unirl.types.constraints import AtLeastOne, check_fields


@dataclass
class TinySD3Config(TinyFlowConfig):
    """A tiny SD3-architecture model for CPU runs and tests.

    `resolution` is the image size in pixels. In pixel space the transformer
    sees [B, 3, resolution, resolution]; otherwise a small random AutoencoderKL
    with a `vae_downsample`x downsample (a power of 2) gives `latent_channels`
    latents. `qk_norm`, `dual_attention_layers` and `pos_embed_max_size` (null:
    the latent grid) are SD3.5's transformer options, so the same config builds an SD3.5-sized denoiser with random
    weights (see `examples/diffusion/sd35m_random_flowgrpo.yaml`). `clip_max_length` is the CLIP
    token budget (SD3 uses 77; a smaller one makes tiny runs faster).
    `words` become whole-word tokens of the tiny CLIP (BPE merges) and T5
    (unigram pieces) tokenizers, which are otherwise character-level: a small
    text encoder learns words far more easily, and prompts get much shorter.
    """

    resolution: AtLeastOne = 32
    pixel_space: bool = True
    patch_size: AtLeastOne = 2
    num_layers: AtLeastOne = 2
    attention_head_dim: AtLeastOne = 32
    num_attention_heads: AtLeastOne = 4
    clip_hidden_size: AtLeastOne = 32
    t5_hidden_size: AtLeastOne = 64
    text_layers: AtLeastOne = 2
    clip_max_length: AtLeastOne = 77
    vae_downsample: int = 2
    qk_norm: str | None = None
    dual_attention_layers: list[int] = field(default_factory=list)
    pos_embed_max_size: int | None = None

    def __post_init__(self) -> None:
        check_fields(self, "model.tiny.")
        check_vae_downsample(self.vae_downsample)
        if self.qk_norm not in (None, "rms_norm", "layer_norm"):
            raise ValueError(f"model.tiny.qk_norm must be null, rms_norm or layer_norm, got {self.qk_norm!r}")
        grid = self.resolution // (1 if self.pixel_space else self.vae_downsample) // self.patch_size
        if self.pos_embed_max_size is not None and self.pos_embed_max_size < grid:
            raise ValueError(
                f"model.tiny.pos_embed_max_size={self.pos_embed_max_size} is smaller than the latent grid "
                f"({grid} patches per side); leave it null to use the grid"
            )
        bad = [i for i in self.dual_attention_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ValueError(
                f"model.tiny.dual_attention_layers {bad} are not layer indices in [0, {self.num_layers})"
            )
        cell = (1 if self.pixel_space else self.vae_downsample) * self.patch_size
        if self.resolution % cell:
            raise ValueError(
                f"model.tiny.resolution={self.resolution} must be a multiple of {cell} "
                f"(patch_size {self.patch_size}{'' if self.pixel_space else f' x vae_downsample {self.vae_downsample}'})"
            )
        if self.clip_hidden_size % 2:
            raise ValueError(
                f"model.tiny.clip_hidden_size must be even (2 CLIP attention heads), got {self.clip_hidden_size}"
            )


@dataclass
class SD3ModelConfig(FlowFamilyConfig):
    """Which SD3 model to build (exactly one of `pretrained_path` / `tiny`).

    Attributes:
        pretrained_path: local diffusers directory of a real SD3 / SD3.5 model.
    """

    SPEC: ClassVar[FamilySpec] = FamilySpec(
        name="SD3 / SD3.5", bundle="unirl.models.sd3.bundle.SD3Bundle", transformer="SD3Transformer2DModel",
        pipeline="StableDiffusion3Pipeline",
    )  # fmt: skip

    tiny: TinySD3Config | None = field(default_factory=TinySD3Config)

    def size_problems(self, height: int, width: int, key: str = "sampling") -> list[str]:
        """height / width vs the latent patch grid (vae scale x patch size pixels per token) and,
        for a tiny model, its position embedding (at most `tiny.resolution`); the messages name
        `{key}.height` / `{key}.width`."""
        geometry = self._geometry()
        if geometry is None:
            return []
        cell, largest = geometry
        problems = []
        for side, value in (("height", height), ("width", width)):
            if value % cell:
                problems.append(
                    f"{key}.{side}={value} must be a multiple of {cell}, the pixels per latent patch of the model"
                )
            if largest is not None and value > largest:
                problems.append(
                    f"{key}.{side}={value} exceeds model.tiny.resolution={largest}, the largest size "
                    "the tiny model's position embedding covers"
                )
        return problems

    def guidance_problems(self, guidance_scale: float, key: str) -> list[str]:
        """None: SD3 takes any classifier-free guidance scale >= 1 (the sampling params' own check)."""
        return []

    def _geometry(self) -> tuple[int, int | None] | None:
        """(pixels per latent patch, largest height/width or None), None when unreadable."""
        if not self.pretrained_path:
            tiny = self.tiny
            return (1 if tiny.pixel_space else tiny.vae_downsample) * tiny.patch_size, tiny.resolution
        try:
            with open(os.path.join(self.pretrained_path, "transformer", "config.json")) as f:
                patch = json.load(f)["patch_size"]
            vae_config = os.path.join(self.pretrained_path, "vae", "config.json")
            scale = 1
            if os.path.exists(vae_config):
                with open(vae_config) as f:
                    scale = 2 ** (len(json.load(f)["block_out_channels"]) - 1)
        except (OSError, KeyError, ValueError):
            return None  # an unreadable model directory is reported by directory_problems / the load
        return scale * patch, None
