"""The Wan 2.1 text-to-video family's recipe node: which model to build, its clip length, and its
answers to the validator.

`WanModelConfig(pretrained_path=<dir>)` names a local diffusers Wan 2.1 or 2.2 T2V directory (a
`WanPipeline`: transformer/, vae/ (AutoencoderKLWan), text_encoder/ (UMT5), tokenizer/,
scheduler/; Wan 2.2 A14B adds transformer_2/ and the pipeline's `boundary_ratio`: two experts,
`unirl.models.wan.experts`); `WanModelConfig(tiny=TinyWanConfig(...))` a tiny random one built
from configs, offline (`tiny.boundary_ratio` set: two experts). `num_frames` is the clip length every sample has (the family's geometry, like the VAE:
a latent sample is [C, f, h, w] with f = (num_frames - 1) / temporal + 1).
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, replace
from typing import Annotated, Any, ClassVar

import torch
from annotated_types import Ge

from unirl.models.flow.config import (
    ConditionedFamilyConfig,
    FamilySpec,
    FlowFamilyConfig,
    TinyFlowConfig,
    cell_size_problems,
    check_video_vae_scales,
    frames_problems,
    read_vae_config,
)
from unirl.types.constraints import AtLeastOne, OpenUnit, check_fields

PATCH = (1, 2, 2)
"""The transformer's (frame, height, width) patch: Wan 2.1's, and the tiny model's."""

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
"""Wan's attention projections, as peft name suffixes: self-attention (`attn1`) and the text
cross-attention (`attn2`) of every block (flow_grpo's Wan LoRA targets; add "ffn.net.0.proj" and
"ffn.net.2" to train the feed-forward too)."""


@dataclass
class TinyWanConfig(TinyFlowConfig):
    """A tiny Wan 2.1-architecture video model for CPU runs and tests (random weights).

    `resolution` is the frame side in pixels the model is built for (Wan's rotary embedding takes
    any size; `sample_size` reports this one). In pixel space the transformer denoises RGB
    frames in [-1, 1] ([3, F, H, W], no temporal or spatial compression); otherwise a small random
    `AutoencoderKLWan` (causal 3D convolutions) compresses `vae_spatial`x along each side and
    `vae_temporal`x along time (the first frame alone, then groups of `vae_temporal`: Wan's
    1 + 4k frames at temporal 4) into `latent_channels` channels, normalized per channel by
    a fixed latents mean / std as Wan's VAE is; its widths are `vae_base_dim` x Wan's multipliers
    (1, 2, 4, 4) with `vae_res_blocks` residual blocks per level (Wan's VAE: 96 and 2 at 8x / 4x).
    The transformer patches (1, 2, 2). `words` become whole-word tokens of the tiny UMT5 tokenizer.
    `boundary_ratio` (in (0, 1)) makes it a Wan 2.2 A14B-style model: two experts of this
    architecture, the high-noise one for timesteps >= boundary_ratio x 1000 (Wan 2.2 T2V: 0.875,
    I2V: 0.9); null: one transformer, as Wan 2.1.
    """

    resolution: AtLeastOne = 16
    pixel_space: bool = True
    num_layers: AtLeastOne = 2
    attention_head_dim: AtLeastOne = 12
    num_attention_heads: AtLeastOne = 2
    ffn_dim: AtLeastOne = 48
    freq_dim: AtLeastOne = 32
    text_hidden_size: AtLeastOne = 32
    text_layers: AtLeastOne = 1
    vae_spatial: int = 2
    vae_temporal: int = 2
    vae_base_dim: AtLeastOne = 8
    vae_res_blocks: AtLeastOne = 1
    boundary_ratio: OpenUnit | None = None

    def __post_init__(self) -> None:
        self.words = list(self.words)
        check_fields(self, "model.tiny.")
        if self.attention_head_dim % 2 or self.attention_head_dim < 6:
            raise ValueError(
                f"model.tiny.attention_head_dim must be even and >= 6 (Wan's rotary embedding splits it "
                f"into even parts over frames, rows and columns), got {self.attention_head_dim}"
            )
        if self.freq_dim % 2:
            raise ValueError(f"model.tiny.freq_dim must be even, got {self.freq_dim}")
        check_video_vae_scales(self.vae_spatial, self.vae_temporal)

    @property
    def scales(self) -> tuple[int, int]:
        """(temporal, spatial) compression of the latents (1, 1 in pixel space)."""
        return (1, 1) if self.pixel_space else (self.vae_temporal, self.vae_spatial)


@dataclass
class WanModelConfig(FlowFamilyConfig):
    """Which Wan 2.1 T2V model to build (exactly one of `pretrained_path` / `tiny`), and the clip
    length it samples.

    Attributes:
        pretrained_path: local diffusers directory of a Wan 2.1 T2V model (`WanPipeline`).
        num_frames: frames per video; with a VAE of temporal compression t it must be 1 + k t
            (Wan's VAE: 1, 5, ..., 81).
        guidance_scale_2: Wan 2.2 A14B's `guidance_scale_2`: the classifier-free guidance scale
            of the steps the low-noise expert denoises (the anchors' T2V: 3.0 beside 4.0); null:
            `sampling.guidance_scale` on every step. Two experts only (checked before Ray); the
            uncond branch runs when `sampling.guidance_scale` > 1, as in `WanPipeline`.
    """

    SPEC: ClassVar[FamilySpec] = FamilySpec(
        name="Wan 2.1 T2V", bundle="unirl.models.wan.bundle.WanBundle", transformer="WanTransformer3DModel",
        pipeline="WanPipeline",
    )  # fmt: skip

    tiny: TinyWanConfig | None = field(default_factory=TinyWanConfig)
    num_frames: AtLeastOne = 81
    guidance_scale_2: Annotated[float, Ge(1)] | None = None

    def bundle_options(self) -> dict[str, int]:
        return {"num_frames": self.num_frames}

    def build(self) -> Any:
        bundle = super().build()
        bundle.guidance_scale_2 = self.guidance_scale_2
        return bundle

    def load_checkpoint(self, path: str) -> Any:
        bundle = super().load_checkpoint(path)
        bundle.guidance_scale_2 = self.guidance_scale_2
        return bundle

    def size_problems(self, height: int, width: int) -> list[str]:
        """Wan's geometry: height and width multiples of the VAE's spatial scale x the 2x2 patch
        (16 px with Wan's VAE), and `model.num_frames` = 1 + k x the VAE's temporal scale (Wan's
        causal VAE keeps the first frame alone and compresses the rest in groups)."""
        scales = self.scales()
        if scales is None:
            return []
        temporal, spatial = scales
        cell = spatial * PATCH[1]
        return cell_size_problems(height, width, cell, "Wan patches") + frames_problems(
            self.num_frames, temporal, "Wan's VAE"
        )

    def guidance_problems(self, guidance_scale: float, key: str) -> list[str]:
        """Wan runs classifier-free guidance (cond and uncond forwards): any scale >= 1 (1 is
        unguided); the type and range checks of the key refuse the rest. `guidance_scale_2`
        needs Wan 2.2's two experts."""
        if self.guidance_scale_2 is None or self.two_experts():
            return []
        return [
            f"model.guidance_scale_2={self.guidance_scale_2}: the low-noise expert's scale needs Wan 2.2's two "
            "experts (model.tiny.boundary_ratio, or a directory with transformer_2/); set it to null"
        ]

    def scales(self) -> tuple[int, int] | None:
        """(temporal, spatial) compression, from the tiny config or the directory's vae/config.json
        (no vae/: pixel space, (1, 1)); None when unreadable (reported by the load)."""
        if not self.pretrained_path:
            return self.tiny.scales
        try:
            vae = read_vae_config(self.pretrained_path)
            if vae is None:
                return (1, 1)
            return int(vae.get("scale_factor_temporal") or 4), int(vae.get("scale_factor_spatial") or 8)
        except (OSError, KeyError, ValueError, TypeError):
            return None

    def two_experts(self) -> bool:
        """Whether the model is Wan 2.2 A14B-style (two experts): a tiny `boundary_ratio`, or a
        directory with `transformer_2/`."""
        if not self.pretrained_path:
            return self.tiny.boundary_ratio is not None
        return os.path.isdir(os.path.join(self.pretrained_path, "transformer_2"))

    def trainable_on_meta(self) -> torch.nn.Module:
        """The denoiser's module tree on the meta device: the transformer, or both experts as one
        `WanExperts` (their LoRA targets and FSDP blocks are checked in both)."""
        high = super().trainable_on_meta()
        if not self.two_experts():
            return high
        from diffusers import WanTransformer3DModel

        from unirl.models.wan.experts import WanExperts

        with torch.device("meta"):
            if self.pretrained_path:
                config = WanTransformer3DModel.load_config(
                    os.path.join(self.pretrained_path, "transformer_2")
                )
                low = WanTransformer3DModel.from_config(config)
            else:
                low = self.modeling().tiny_transformer(self.tiny)
        return WanExperts(high, low, boundary_timestep=0.0)  # the tree alone: no routing

    def directory_problems(self) -> list[str]:
        """The family's directory check, and for a Wan 2.2 A14B directory (a `transformer_2/`) a
        `boundary_ratio` in (0, 1) in its model_index.json."""
        problems = super().directory_problems()
        if problems or not self.pretrained_path or not self.two_experts():
            return problems
        try:
            with open(os.path.join(self.pretrained_path, "model_index.json")) as f:
                ratio = json.load(f).get("boundary_ratio")
        except (OSError, ValueError):
            return problems
        if not isinstance(ratio, int | float) or not 0 < ratio < 1:
            problems.append(
                f"model.pretrained_path {self.pretrained_path!r} has a transformer_2/ (Wan 2.2's low-noise expert) "
                f"but its model_index.json sets boundary_ratio={ratio!r}; it must be in (0, 1) (Wan 2.2 T2V: 0.875, "
                "I2V: 0.9)"
            )
        return problems


@dataclass
class WanI2VModelConfig(ConditionedFamilyConfig, WanModelConfig):
    """Which Wan 2.2 image-to-video model to build: a local `WanImageToVideoPipeline` directory of
    the Wan 2.2 I2V-A14B layout (no image encoder; two experts at `boundary_ratio` 0.9), or the
    tiny model of `tiny` (latent space; its transformer takes the latents, the first-frame mask and
    the frame's latents). Its prompt rows each carry one first frame under `condition_key`
    (`condition_problems`; a data source resolves that key's relative paths when it is in its
    `path_keys`); the frame is resized to the sampled size."""

    SPEC: ClassVar[FamilySpec] = replace(
        WanModelConfig.SPEC, name="Wan 2.2 I2V", bundle="unirl.models.wan.i2v.WanI2VBundle",
        pipeline="WanImageToVideoPipeline",
    )  # fmt: skip
    condition_key: str = "images"

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tiny is not None and self.tiny.pixel_space:
            raise ValueError(
                "model.tiny.pixel_space must be false: Wan I2V encodes its first frame with the VAE"
            )

    def condition_problems(self, examples: list, where: str, sampling: Any = None) -> list[str]:
        """Every prompt row of `where` (its examples) names a first frame, or a first and a last
        frame, that read (any size: they are resized to the sampled one); problems name the row."""
        from unirl.models.images import row_images

        problems: list[str] = []
        need = "Wan I2V animates one first frame, or a first and a last frame"
        for row, images in row_images(examples, self.condition_key, where, problems, "frame(s)", need, False):
            if len(images) > 2:
                problems.append(
                    f"{where}: prompt {row.prompt_id!r} carries {len(images)} frame(s) in metadata "
                    f"{self.condition_key!r}; {need}"
                )
        return problems
