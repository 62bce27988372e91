"""The FLUX.2 family's recipe nodes: which model to build, and its answers to the validator.

`Flux2ModelConfig(pretrained_path=<dir>)` names a local diffusers FLUX.2-dev directory (a
`Flux2Pipeline`: transformer/ (Flux2Transformer2DModel), vae/ (AutoencoderKLFlux2),
text_encoder/ (Mistral3ForConditionalGeneration), tokenizer/, scheduler/);
`Flux2KleinModelConfig` a FLUX.2-Klein one (`Flux2KleinPipeline`: a Qwen3ForCausalLM
text_encoder/ and its tokenizer). Either takes `tiny=TinyFlux2Config(...)` for a tiny random
model built from configs, offline. `Flux2EditModelConfig` / `Flux2KleinEditModelConfig` are the
same models reading reference images from each prompt row (`unirl.models.flux2.references`). The
bundles (`unirl.models.flux2.bundle`, `references`) are named by `SPEC`, not imported here.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from unirl.models.flow.config import (
    ConditionedFamilyConfig,
    FamilySpec,
    FlowFamilyConfig,
    TinyFlowConfig,
    cell_size_problems,
    check_vae_downsample,
    latent_patch_cell,
)
from unirl.types.constraints import AtLeastOne, NonNegativeInt, check_fields

LORA_TARGETS = [
    "to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out",
    "to_qkv_mlp_proj",
]  # fmt: skip
"""FLUX.2's attention projections, as peft name suffixes: the image and text streams of the
double-stream blocks (`to_*`, `add_*`, `to_add_out`) and the fused q/k/v + MLP input projection of
the single-stream blocks (`to_qkv_mlp_proj`; their output projection is `attn.to_out`, a name
the double-stream blocks' `to_out` list shares, so it is left out); add "linear_in" and
"linear_out" to train the double-stream feed-forwards too."""

TEXT_LAYERS = {"mistral3": (10, 20, 30), "qwen3": (9, 18, 27)}
"""The prompt encoder's hidden states the pipelines stack into a caption (their
`text_encoder_out_layers` defaults): FLUX.2-dev's Mistral 3 and Klein's Qwen3."""


@dataclass
class TinyFlux2Config(TinyFlowConfig):
    """A tiny FLUX.2-architecture model for CPU runs and tests (random weights).

    `resolution` is the image side in pixels the model is built for. A small random
    `AutoencoderKLFlux2` downsamples `vae_downsample`x into `latent_channels` latents, normalised
    per 2x2-patch channel by its batch-norm statistics (set here to a fixed spread, not the
    identity, so the normalisation is exercised); the transformer (`num_layers` double-stream and
    `num_single_layers` single-stream blocks, `num_attention_heads` x `attention_head_dim`) takes
    each 2x2 patch of latent cells as one token, with 4-axis rotary positions (`axes_dims_rope`:
    4 even sizes summing to the head dim). `guidance_embeds` makes the scale a network input
    (FLUX.2-dev); Klein's transformer has none. The prompt encoder is tiny and `text_layers` deep
    (at least the deepest hidden state the pipeline stacks: 30 for FLUX.2-dev's Mistral 3, 27
    for Klein's Qwen3, so the tiny model is read exactly as the real one), `text_hidden_size`
    wide, over a byte-level BPE tokenizer where the pipeline's prompt template and `words` are
    whole tokens. Latent space only: the pipelines decode with their VAE.
    """

    ENCODER: ClassVar[str] = "mistral3"  # the prompt encoder whose hidden states the pipeline stacks

    resolution: AtLeastOne = 32
    pixel_space: bool = False
    num_layers: AtLeastOne = 1
    num_single_layers: NonNegativeInt = 1
    attention_head_dim: AtLeastOne = 16
    num_attention_heads: AtLeastOne = 2
    axes_dims_rope: list[int] = field(default_factory=lambda: [4, 4, 4, 4])
    guidance_embeds: bool = True
    text_hidden_size: AtLeastOne = 16
    text_layers: AtLeastOne = 30
    vae_downsample: int = 2

    def __post_init__(self) -> None:
        self.axes_dims_rope = list(self.axes_dims_rope)
        self.words = list(self.words)
        check_fields(self, "model.tiny.")
        if self.pixel_space:
            raise ValueError(
                "model.tiny.pixel_space must be false: the FLUX.2 pipelines decode with their VAE"
            )
        check_vae_downsample(self.vae_downsample)
        dims = self.axes_dims_rope
        if len(dims) != 4 or sum(dims) != self.attention_head_dim or any(d % 2 for d in dims):
            raise ValueError(
                f"model.tiny.axes_dims_rope={dims} must be 4 even sizes summing to "
                f"model.tiny.attention_head_dim={self.attention_head_dim} (FLUX.2's rotary axes: "
                "reference, row, column, text position)"
            )
        if self.text_hidden_size % 2:
            raise ValueError(
                f"model.tiny.text_hidden_size must be even (2 heads), got {self.text_hidden_size}"
            )
        deepest = max(TEXT_LAYERS[self.ENCODER])
        if self.text_layers < deepest:
            raise ValueError(
                f"model.tiny.text_layers={self.text_layers}: the pipeline stacks the prompt encoder's hidden "
                f"states {TEXT_LAYERS[self.ENCODER]}, so the tiny encoder needs at least {deepest} layers"
            )

    @property
    def vae_scale_factor(self) -> int:
        """Pixels per latent cell along a side."""
        return self.vae_downsample


@dataclass
class TinyFlux2KleinConfig(TinyFlux2Config):
    """`TinyFlux2Config` with Klein's defaults: no guidance embedding (which Klein must not have),
    a 27-layer Qwen3 prompt encoder."""

    ENCODER: ClassVar[str] = "qwen3"

    guidance_embeds: bool = False
    text_layers: AtLeastOne = 27

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.guidance_embeds:
            raise ValueError(
                "model.tiny.guidance_embeds must be false for FLUX.2-Klein: Flux2KleinPipeline passes the "
                "transformer no guidance (it guides by classifier-free guidance)"
            )


@dataclass
class Flux2ModelConfig(FlowFamilyConfig):
    """Which FLUX.2-dev model to build (exactly one of `pretrained_path` / `tiny`).

    Attributes:
        pretrained_path: local diffusers directory of a FLUX.2-dev model (`Flux2Pipeline`).
    """

    SPEC: ClassVar[FamilySpec] = FamilySpec(
        name="FLUX.2-dev", bundle="unirl.models.flux2.bundle.Flux2Bundle",
        transformer="Flux2Transformer2DModel", pipeline="Flux2Pipeline",
    )  # fmt: skip

    tiny: TinyFlux2Config | None = field(default_factory=TinyFlux2Config)

    def size_problems(self, height: int, width: int, key: str = "sampling") -> list[str]:
        """Sides must be multiples of 2 x the VAE's spatial scale (a token is a 2x2 patch of latent
        cells: 16 px with FLUX.2's 8x VAE)."""
        cell = latent_patch_cell(self.pretrained_path, self.tiny)
        return [] if cell is None else cell_size_problems(height, width, cell, "FLUX.2 patches", key)

    def guidance_problems(self, guidance_scale: float, key: str) -> list[str]:
        """FLUX.2-dev embeds the scale (any value >= 1); a transformer without the guidance
        embedding takes none, so only 1.0."""
        embeds = self._transformer_config("guidance_embeds")
        if embeds is None or embeds or guidance_scale == 1.0:
            return []
        return [
            f"{key}={guidance_scale}: this FLUX.2 transformer has no guidance embedding (guidance_embeds "
            f"false) and Flux2Pipeline runs no classifier-free guidance; set {key}: 1.0"
        ]

    def _transformer_config(self, key: str) -> bool | None:
        if not self.pretrained_path:
            return getattr(self.tiny, key)
        try:
            with open(os.path.join(self.pretrained_path, "transformer", "config.json")) as f:
                return bool(json.load(f).get(key, False))
        except (OSError, ValueError):
            return None


@dataclass
class Flux2KleinModelConfig(Flux2ModelConfig):
    """Which FLUX.2-Klein model to build: a `Flux2KleinPipeline` directory (a Qwen3 prompt
    encoder, no guidance embedding, classifier-free guidance against the empty prompt), or a
    tiny one (`TinyFlux2KleinConfig`: `guidance_embeds` must stay false, `text_layers` at least 27). A
    step-distilled Klein (`is_distilled` in its `model_index.json`) takes no guidance."""

    SPEC: ClassVar[FamilySpec] = FamilySpec(
        name="FLUX.2-Klein", bundle="unirl.models.flux2.bundle.Flux2KleinBundle",
        transformer="Flux2Transformer2DModel", pipeline="Flux2KleinPipeline",
    )  # fmt: skip

    tiny: TinyFlux2KleinConfig | None = field(default_factory=TinyFlux2KleinConfig)

    def load_checkpoint(self, path: str):
        """The bundle of a UniRL checkpoint of a Klein run, fp32."""
        modeling = self.modeling()
        return modeling.load_checkpoint(path, bundle_class=modeling.Flux2KleinBundle)

    def guidance_problems(self, guidance_scale: float, key: str) -> list[str]:
        """Klein guides by classifier-free guidance at any scale >= 1; a step-distilled Klein
        (`is_distilled`) ignores the scale in its pipeline, so only 1.0 says what runs."""
        if guidance_scale == 1.0 or not self.pretrained_path:
            return []
        try:
            with open(os.path.join(self.pretrained_path, "model_index.json")) as f:
                distilled = bool(json.load(f).get("is_distilled", False))
        except (OSError, ValueError):
            return []
        if not distilled:
            return []
        return [
            f"{key}={guidance_scale}: this FLUX.2-Klein is step-distilled (is_distilled in its "
            f"model_index.json) and samples without guidance; set {key}: 1.0"
        ]


REFERENCE_KEY = "images"
"""The default prompt-row metadata key naming a sample's reference images (paths, arrays or PIL
images); a config's `condition_key` names another."""


def reference_layout(width: int, height: int, cell: int) -> tuple[int, int]:
    """(rows, cols) of packed tokens of a reference of width x height px, as the pipelines
    prepare it: shrunk to 1024 x 1024 px of area when larger, sides floored to multiples of `cell`
    (`unirl.models.flux2.references.reference_size`)."""
    if width * height > 1024 * 1024:
        scale = math.sqrt(1024 * 1024 / (width * height))
        width, height = int(width * scale), int(height * scale)
    return height // cell, width // cell


class ReferenceConditions(ConditionedFamilyConfig):
    """What a FLUX.2 config adds for reference images (`unirl.models.flux2.references`): the
    bundle reads `condition_key` of each row, and `condition_problems` checks every prompt row
    before Ray. The dataclass that mixes it in declares `condition_key`."""

    def condition_problems(self, examples: list, where: str, sampling: Any = None) -> list[str]:
        """Every prompt row of `where` (its examples) names one or more references that read and
        keep at least one packed cell per side, and every row the same number of references with
        the same packed sizes (a request batches its rows); problems name the row. (`sampling` is
        not read: the references do not enter the prompt.)"""
        from unirl.models.images import row_images

        key, cell = self.condition_key, latent_patch_cell(self.pretrained_path, self.tiny)
        problems, layouts = [], {}
        need = f"{self.SPEC.name} with references reads one or more"
        for ex, images in row_images(examples, key, where, problems, "reference image", need, False):
            layout = [reference_layout(image.width, image.height, cell or 1) for image in images]
            small = [i for i, (rows, cols) in enumerate(layout) if not rows or not cols]
            if small:
                image = images[small[0]]
                problems.append(
                    f"{where}: prompt {ex.prompt_id!r}: reference {small[0]} is {image.width}x{image.height} px, "
                    f"under one packed cell of {cell} px on a side"
                )
                continue
            layouts.setdefault(tuple(layout), ex.prompt_id)
        if len(layouts) > 1:
            problems.append(
                f"{where}: rows whose references pack into different token grids {sorted(layouts)} (e.g. prompts "
                f"{list(layouts.values())[:2]}); a request batches its rows: give every row the same number of "
                "references with the same sizes"
            )
        return problems


@dataclass
class Flux2EditModelConfig(ReferenceConditions, Flux2ModelConfig):
    """FLUX.2-dev reading reference images (`Flux2Pipeline`'s `image`): a local `Flux2Pipeline`
    directory or the tiny model (the same modules; the references are inputs). Each prompt row
    names its references under `condition_key`."""

    SPEC: ClassVar[FamilySpec] = replace(
        Flux2ModelConfig.SPEC, bundle="unirl.models.flux2.references.Flux2EditBundle",
    )  # fmt: skip
    condition_key: str = REFERENCE_KEY


@dataclass
class Flux2KleinEditModelConfig(ReferenceConditions, Flux2KleinModelConfig):
    """FLUX.2-Klein reading reference images (`Flux2KleinPipeline`'s `image`)."""

    SPEC: ClassVar[FamilySpec] = replace(
        Flux2KleinModelConfig.SPEC, bundle="unirl.models.flux2.references.Flux2KleinEditBundle",
    )  # fmt: skip
    condition_key: str = REFERENCE_KEY

    def load_checkpoint(self, path: str):
        modeling = self.modeling()
        return self.conditioned(modeling.load_checkpoint(path, bundle_class=modeling.Flux2KleinEditBundle))
