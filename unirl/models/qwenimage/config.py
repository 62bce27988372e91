"""The Qwen-Image family's recipe node: which model to build, its negative prompt, and its answers
to the validator.

`QwenImageModelConfig(pretrained_path=<dir>)` names a local diffusers Qwen-Image directory (a
`QwenImagePipeline`: transformer/ (QwenImageTransformer2DModel), vae/ (AutoencoderKLQwenImage),
text_encoder/ (Qwen2.5-VL), tokenizer/, scheduler/); `QwenImageModelConfig(tiny=TinyQwenImageConfig(...))`
a tiny random one built from configs, offline.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from unirl.models.flow.config import (
    ConditionedFamilyConfig,
    FamilySpec,
    FlowFamilyConfig,
    PackedTinyConfig,
    cell_size_problems,
    read_vae_config,
)
from unirl.types.constraints import AtLeastOne, check_fields

LORA_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"]
"""Qwen-Image's attention projections, as peft name suffixes: the image stream (`to_*`) and the
text stream (`add_*`, `to_add_out`) of every double-stream block; add "img_mlp.net.0.proj",
"img_mlp.net.2", "txt_mlp.net.0.proj" and "txt_mlp.net.2" to train the feed-forwards too (verl's
Qwen-Image Flow-GRPO example trains all twelve)."""


@dataclass
class TinyQwenImageConfig(PackedTinyConfig):
    """A tiny Qwen-Image-architecture model for CPU runs and tests (random weights).

    `resolution` is the image side in pixels the model is built for (the rotary embedding takes
    any size; `sample_size` reports this one). In pixel space the transformer denoises RGB in
    [-1, 1] packed 2x2 (12 channels per token); otherwise a small random `AutoencoderKLQwenImage`
    (Wan-style causal 3D convolutions on one frame) with a `vae_downsample`x spatial downsample
    gives `latent_channels` latents, normalized per channel by a fixed latents mean / std as
    Qwen-Image's VAE is, packed 2x2. `axes_dims_rope` (frame, row, column) must sum to
    `attention_head_dim`. The text encoder is a tiny `Qwen2_5_VLForConditionalGeneration`
    (`unirl.models.causal_lm.tiny.tiny_vlm_model`, `text_hidden_size` wide, `text_layers`
    deep); its tokenizer is byte-level BPE with the prompt template's words and `words` as whole
    tokens, so the template's system prefix is the 34 tokens QwenImagePipeline drops, as with
    Qwen2.5-VL's own tokenizer. `zero_cond_t` (Qwen-Image-Edit-2511's transformer) modulates an
    edit's reference tokens at timestep 0; a model without references is unchanged by it.
    """

    resolution: AtLeastOne = 32
    pixel_space: bool = True
    num_layers: AtLeastOne = 2
    attention_head_dim: AtLeastOne = 16
    num_attention_heads: AtLeastOne = 2
    axes_dims_rope: list[int] = field(default_factory=lambda: [4, 6, 6])
    text_hidden_size: AtLeastOne = 32
    text_layers: AtLeastOne = 1
    vae_downsample: int = 2
    vae_base_dim: AtLeastOne = 8
    zero_cond_t: bool = False

    def __post_init__(self) -> None:
        self.axes_dims_rope = list(self.axes_dims_rope)
        self.words = list(self.words)
        check_fields(self, "model.tiny.")
        self.check_packed_geometry()
        if self.text_hidden_size % 16:
            raise ValueError(
                "model.tiny.text_hidden_size must be a multiple of 16 (2 heads whose dim splits into "
                f"Qwen2.5-VL's multimodal rotary sections), got {self.text_hidden_size}"
            )


@dataclass
class QwenImageModelConfig(FlowFamilyConfig):
    """Which Qwen-Image model to build (exactly one of `pretrained_path` / `tiny`).

    Attributes:
        pretrained_path: local diffusers directory of a Qwen-Image model (`QwenImagePipeline`).
        negative_prompt: the prompt of true CFG's uncond branch (QwenImagePipeline's
            `negative_prompt`; " " is its documented default). With `sampling.guidance_scale` > 1
            it must be set: QwenImagePipeline runs no CFG without one.
    """

    SPEC: ClassVar[FamilySpec] = FamilySpec(
        name="Qwen-Image", bundle="unirl.models.qwenimage.bundle.QwenImageBundle",
        transformer="QwenImageTransformer2DModel", pipeline="QwenImagePipeline",
    )  # fmt: skip

    tiny: TinyQwenImageConfig | None = field(default_factory=TinyQwenImageConfig)
    negative_prompt: str | None = " "

    def bundle_options(self) -> dict[str, str | None]:
        return {"negative_prompt": self.negative_prompt}

    def size_problems(self, height: int, width: int, key: str = "sampling") -> list[str]:
        """Sides must be multiples of 2 x the VAE's spatial scale (the 2x2 packing of latent cells:
        16 px with Qwen-Image's 8x VAE, 2 x vae_downsample for a tiny one, 2 in pixel space)."""
        cell = self._cell()
        if cell is None:
            return []
        return cell_size_problems(height, width, cell, "Qwen-Image packs", key)

    def guidance_problems(self, guidance_scale: float, key: str) -> list[str]:
        """Qwen-Image's guidance is true CFG (`true_cfg_scale`; the sampling params already refuse
        scales below 1): 1.0 runs none, a scale > 1 runs the negative prompt's branch and the
        norm-rescaled combination, and needs `model.negative_prompt` (QwenImagePipeline runs no
        CFG without one)."""
        if guidance_scale > 1.0 and self.negative_prompt is None:
            return [
                f"{key}={guidance_scale} runs Qwen-Image's true CFG, whose uncond branch is the negative "
                "prompt, but model.negative_prompt is null; set model.negative_prompt (e.g. ' ', "
                f"QwenImagePipeline's default) or {key}: 1.0"
            ]
        return []

    def _cell(self) -> int | None:
        """Pixels per packed token along a side, from the tiny config or the directory's VAE
        config; None when unreadable (reported by the load)."""
        if not self.pretrained_path:
            return 2 * self.tiny.vae_scale_factor
        try:
            vae = read_vae_config(self.pretrained_path)
            if vae is None:
                return 2  # pixel space: the 2x2 packing of pixels
            return 2 * 2 ** len(vae["temperal_downsample"])
        except (OSError, KeyError, ValueError, TypeError):
            return None


CONDITION_AREA = 384 * 384
"""Pixels of a reference as Qwen-Image-Edit-Plus's prompt encoder sees it (the pipeline's
`CONDITION_IMAGE_SIZE`)."""
VAE_AREA = 1024 * 1024
"""Pixels of a reference as its VAE encodes it (the pipeline's `VAE_IMAGE_SIZE`)."""


@dataclass
class TinyQwenImageEditConfig(TinyQwenImageConfig):
    """A tiny Qwen-Image-Edit-Plus: the tiny Qwen-Image, in latent space by default (the pipeline
    VAE-encodes its references; a pixel-space model packs their pixels instead, which no pipeline
    can run)."""

    pixel_space: bool = False


@dataclass
class QwenImageEditPlusModelConfig(ConditionedFamilyConfig, QwenImageModelConfig):
    """Which Qwen-Image-Edit-Plus model to build (a local `QwenImageEditPlusPipeline` directory
    such as Qwen-Image-Edit-2509 / 2511, or the tiny model of `tiny`), and how it reads its
    references. Its prompt rows each carry one or more references under `condition_key`
    (`condition_problems`; a data source resolves that key's relative paths when it is in its
    `path_keys`).

    Attributes (beyond `QwenImageModelConfig`'s):
        condition_key: the prompt-row metadata key of the references.
        condition_area: pixels of a reference as the prompt encoder sees it (the pipeline's
            384 x 384; a tiny recipe lowers it with its images).
        vae_area: pixels of a reference as the VAE encodes it (the pipeline's 1024 x 1024).
    """

    SPEC: ClassVar[FamilySpec] = replace(
        QwenImageModelConfig.SPEC, name="Qwen-Image-Edit-Plus",
        bundle="unirl.models.qwenimage.edit.QwenImageEditPlusBundle", pipeline="QwenImageEditPlusPipeline",
    )  # fmt: skip

    tiny: TinyQwenImageEditConfig | None = field(default_factory=TinyQwenImageEditConfig)
    condition_key: str = "images"
    condition_area: AtLeastOne = CONDITION_AREA
    vae_area: AtLeastOne = VAE_AREA

    def bundle_options(self) -> dict[str, Any]:
        return {
            **super().bundle_options(),
            "condition_area": self.condition_area,
            "vae_area": self.vae_area,
        }

    def condition_problems(self, examples: list, where: str, sampling: Any = None) -> list[str]:
        """Every prompt row of `where` (its examples) names one or more references that read, each
        resizing to a nonzero size for the VAE, and every row the same number of references with
        the same packed sizes (a request batches its rows); with `sampling`, each row's prompt
        with its references' vision tokens fits `sampling.max_sequence_length` (counted by the
        model's processor, no weights read). Problems name the row."""
        from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import calculate_dimensions

        from unirl.models.images import row_images

        key, cell = self.condition_key, self._cell()
        problems, layouts, rows = [], {}, []
        need = "Qwen-Image-Edit-Plus edits one or more"
        for ex, images in row_images(examples, key, where, problems, "reference image", need, False):
            layout = []
            for i, image in enumerate(images):
                w, h = calculate_dimensions(self.vae_area, image.width / image.height)
                if not w or not h:
                    problems.append(
                        f"{where}: prompt {ex.prompt_id!r}: reference {i} ({image.width}x{image.height} px) resizes "
                        f"to {w}x{h} px for the VAE (model.vae_area={self.vae_area}); give references closer to square"
                    )
                    break
                layout.append((h // cell, w // cell) if cell else (h, w))
            else:
                layouts.setdefault(tuple(layout), ex.prompt_id)
                rows.append((ex.prompt_id, ex.prompt, images))
        if sampling is not None and rows and not problems:
            problems.extend(self._length_problems(rows, where, sampling.max_sequence_length))
        if len(layouts) > 1:
            problems.append(
                f"{where}: rows whose references pack into different token grids {sorted(layouts)} (e.g. prompts "
                f"{list(layouts.values())[:2]}); a request batches its rows: give every row the same number of "
                "references with the same side ratios"
            )
        return problems

    def _length_problems(self, rows: list, where: str, max_sequence_length: int) -> list[str]:
        """`rows`: (prompt id, prompt, its references as PIL images) of every readable row."""
        from unirl.models.qwenimage.edit import edit_processor, encoded_prompt_lengths

        try:
            processor = edit_processor(self.pretrained_path, self.tiny)
        except (OSError, ValueError):
            return []  # an unreadable directory is the directory check's problem
        lengths = encoded_prompt_lengths(
            processor, [(p, images) for _, p, images in rows], self.condition_area
        )
        longest, row = max(zip(lengths, (pid for pid, _, _ in rows), strict=True))
        if longest <= max_sequence_length:
            return []
        return [
            f"{where}: prompt {row!r} with its references encodes to {longest} tokens (each reference's vision "
            f"tokens count, at model.condition_area={self.condition_area}), over "
            f"sampling.max_sequence_length={max_sequence_length}: raise it to at least {longest}"
        ]
