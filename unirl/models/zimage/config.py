"""The Z-Image family's recipe node: which model to build, and its answers to the validator.

`ZImageModelConfig(pretrained_path=<dir>)` names a local diffusers Z-Image directory (a
`ZImagePipeline`: transformer/ (ZImageTransformer2DModel), vae/ (AutoencoderKL), text_encoder/
(a Qwen3 model), tokenizer/, scheduler/); `ZImageModelConfig(tiny=TinyZImageConfig(...))` a tiny
random one built from configs, offline. The bundle is `unirl.models.zimage.bundle.ZImageBundle`,
named by `SPEC`, not imported here.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any, ClassVar

from annotated_types import Ge, Le

from unirl.models.flow.config import (
    FamilySpec,
    FlowFamilyConfig,
    PackedTinyConfig,
    cell_size_problems,
    latent_patch_cell,
)
from unirl.types.constraints import AtLeastOne, NonNegative, check_fields

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0"]
"""Z-Image's attention projections, as peft name suffixes: every single-stream block's (the main
layers and the noise / caption refiners); add "w1", "w2", "w3" to train the feed-forwards too."""


@dataclass
class TinyZImageConfig(PackedTinyConfig):
    """A tiny Z-Image-architecture model for CPU runs and tests (random weights).

    `resolution` is the image side in pixels the model is built for. A small random
    `AutoencoderKL` (FLUX.1's VAE class, with its scaling and shift factors) downsamples
    `vae_downsample`x into `latent_channels` latents, which the single-stream transformer
    (`dim` wide, `num_heads` heads, `num_layers` main and `num_refiner_layers` noise / caption
    refiner blocks) patchifies 2x2 itself; `axes_dims_rope` (frame, row, column) must sum to the
    head dim `dim / num_heads`. The prompt encoder is a tiny Qwen3 (`text_hidden_size` wide,
    `text_layers` deep; the pipeline reads its second-to-last hidden states, so at least 2) over
    a byte-level BPE tokenizer with Qwen's chat template, the template's words and `words` whole
    tokens. Latent space only: `ZImagePipeline` decodes with its VAE.
    """

    resolution: AtLeastOne = 16
    pixel_space: bool = False
    num_layers: AtLeastOne = 1
    num_refiner_layers: AtLeastOne = 1
    dim: AtLeastOne = 32
    num_heads: AtLeastOne = 2
    axes_dims_rope: list[int] = field(default_factory=lambda: [4, 6, 6])
    text_hidden_size: AtLeastOne = 32
    text_layers: AtLeastOne = 2
    vae_downsample: int = 2

    @property
    def attention_head_dim(self) -> int:
        return self.dim // self.num_heads

    def __post_init__(self) -> None:
        self.axes_dims_rope = list(self.axes_dims_rope)
        self.words = list(self.words)
        check_fields(self, "model.tiny.")
        if self.pixel_space:
            raise ValueError("model.tiny.pixel_space must be false: ZImagePipeline decodes with its VAE")
        if self.dim % self.num_heads:
            raise ValueError(
                f"model.tiny.dim={self.dim} must be a multiple of model.tiny.num_heads={self.num_heads}"
            )
        if self.text_layers < 2:
            raise ValueError(
                "model.tiny.text_layers must be >= 2: Z-Image reads the prompt encoder's second-to-last "
                f"hidden states, got {self.text_layers}"
            )
        self.check_packed_geometry()


@dataclass
class ZImageModelConfig(FlowFamilyConfig):
    """Which Z-Image model to build (exactly one of `pretrained_path` / `tiny`).

    Attributes:
        pretrained_path: local diffusers directory of a Z-Image model (`ZImagePipeline`).
        cfg_normalization: `ZImagePipeline`'s: a guided row whose norm exceeds this multiple of
            its cond output's norm is scaled down to it; 0: off (the pipeline's default).
        cfg_truncation: `ZImagePipeline`'s: no guidance on the steps whose `(1000 - t) / 1000`
            exceeds it (late, low-noise steps); null: off (the pipeline's 1.0 never truncates).
    """

    SPEC: ClassVar[FamilySpec] = FamilySpec(
        name="Z-Image", bundle="unirl.models.zimage.bundle.ZImageBundle",
        transformer="ZImageTransformer2DModel", pipeline="ZImagePipeline",
    )  # fmt: skip

    tiny: TinyZImageConfig | None = field(default_factory=TinyZImageConfig)
    cfg_normalization: NonNegative = 0.0
    cfg_truncation: Annotated[float, Ge(0.0), Le(1.0)] | None = None

    def build(self) -> Any:
        return self._guided(super().build())

    def load_checkpoint(self, path: str) -> Any:
        return self._guided(super().load_checkpoint(path))

    def _guided(self, bundle: Any) -> Any:
        bundle.cfg_normalization, bundle.cfg_truncation = self.cfg_normalization, self.cfg_truncation
        return bundle

    def size_problems(self, height: int, width: int, key: str = "sampling") -> list[str]:
        """Sides must be multiples of 2 x the VAE's spatial scale (the transformer's 2x2 patch of
        latent cells: 16 px with Z-Image's 8x VAE)."""
        cell = latent_patch_cell(self.pretrained_path, self.tiny)
        return [] if cell is None else cell_size_problems(height, width, cell, "Z-Image patches", key)

    def guidance_problems(self, guidance_scale: float, key: str) -> list[str]:
        """Z-Image runs classifier-free guidance against the empty prompt at any scale >= 1 (1:
        none); the type and range checks of the key refuse the rest."""
        return []
