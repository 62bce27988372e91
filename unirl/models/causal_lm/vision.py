"""Vision-language causal LMs (Qwen2.5-VL, Qwen3-VL through transformers): bundle, config, images.

A VLM is a causal LM whose prompt may hold images. The text stage
(`CausalLMStage`) drives it unchanged except for three things this module
supplies through `VLMBundle`:
- `prepare(prompt, images, sample_id)`: reads the images (`load_image`), runs the
  family's image processor and expands each image placeholder of the prompt into
  the image's vision tokens; returns the expanded prompt, the pixel values
  [N_i, D] and the grids [k_i, 3] (t, h, w patches per image) of the sample;
- `positions(input_ids, attention_mask, image_grid_thw)`: the multimodal rotary
  positions [3, B, L] of a padded batch (the model's own `get_rope_index`); text
  tokens after the last image continue one by one, so a generated token's
  position is the previous one + 1 on every axis;
- `vision_inputs(pixel_values, image_grid_thw)`: the forward's keyword arguments.

Prompts name their images with `IMAGE_PLACEHOLDER` ("<image>"), once per image, in
order; a prompt row carries the images in `metadata["images"]` (a list of file
paths, HWC uint8 arrays or PIL images). The counts must agree (an error names the
sample otherwise).

Two ways to build one, as for text LMs:
- `VLMConfig(pretrained_path=<dir>)`: a local Hugging Face VLM directory (its
  `config.json` has a `vision_config`; processor files beside the weights);
- `VLMConfig(tiny=TinyVLMConfig(...))`: a tiny random Qwen2.5-VL or Qwen3-VL from a
  config, with the byte-level tokenizer plus the vision tokens and the family's
  image processor (the PIL backend when torchvision is absent), all built in code.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer, PreTrainedModel

from unirl.models.causal_lm.bundle import CausalLMBundle, TinyLMConfig, model_on_meta, tiny_tokenizer
from unirl.models.images import load_image
from unirl.models.source import DTYPES, DType, check_source, missing_directory_problems
from unirl.types.constraints import AtLeastOne

IMAGE_PLACEHOLDER = "<image>"
VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = (
    "<|vision_start|>",
    "<|image_pad|>",
    "<|vision_end|>",
    "<|video_pad|>",
)
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)


def _tiny_architectures() -> dict[str, tuple[type, type]]:
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    return {
        "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration),
    }


TINY_VLM_ARCHITECTURES = ("qwen2_5_vl", "qwen3_vl")


@dataclass
class TinyVLMConfig(TinyLMConfig):
    """A tiny random VLM: the text decoder of `TinyLMConfig` plus a vision tower.

    `architecture` is "qwen2_5_vl" or "qwen3_vl". An image becomes patches of
    `patch_size` pixels (and `temporal_patch_size` frames: a still image is
    repeated); `spatial_merge_size`^2 patches merge into one LM token, so an
    image of H x W pixels (resized by the processor to multiples of
    patch_size * spatial_merge_size within [min_pixels, max_pixels]) costs
    H W / (patch_size * spatial_merge_size)^2 tokens.
    """

    architecture: str = "qwen2_5_vl"
    vision_depth: AtLeastOne = 2
    vision_hidden_size: AtLeastOne = 32
    vision_intermediate_size: AtLeastOne = 64
    vision_num_heads: AtLeastOne = 2
    patch_size: AtLeastOne = 14
    spatial_merge_size: AtLeastOne = 2
    temporal_patch_size: AtLeastOne = 2
    min_pixels: AtLeastOne = 28 * 28
    max_pixels: int = 28 * 28 * 16
    max_position_embeddings: AtLeastOne = 1024

    def __post_init__(self) -> None:
        if self.architecture not in TINY_VLM_ARCHITECTURES:
            raise ValueError(
                f"model.tiny.architecture must be one of {list(TINY_VLM_ARCHITECTURES)}, "
                f"got {self.architecture!r}"
            )
        arch, self.architecture = self.architecture, "qwen3"  # the decoder's checks are TinyLMConfig's
        try:
            super().__post_init__()
        finally:
            self.architecture = arch
        if self.vision_hidden_size % self.vision_num_heads:
            raise ValueError(
                f"model.tiny.vision_hidden_size={self.vision_hidden_size} must be a multiple of "
                f"model.tiny.vision_num_heads={self.vision_num_heads}"
            )
        if self.max_pixels < self.min_pixels:
            raise ValueError(
                f"model.tiny.max_pixels={self.max_pixels} must be >= model.tiny.min_pixels={self.min_pixels}"
            )
        head = self.hidden_size // self.num_attention_heads
        if head % 8:
            raise ValueError(
                f"model.tiny head dim hidden_size / num_attention_heads = {head} must be a multiple of 8 "
                "(the multimodal rotary sections split head_dim / 2 into temporal, height and width)"
            )


def _mrope_section(head_dim: int) -> list[int]:
    """Split head_dim / 2 rotary frequencies into (temporal, height, width) sections, as
    Qwen's 1:1.5:1.5 split (16, 24, 24 of 64) does."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def tiny_vlm_model(cfg: TinyVLMConfig, vocab_size: int, token_ids: dict[str, int]) -> PreTrainedModel:
    """A randomly initialized tiny VLM, deterministic in `cfg.seed`."""
    config_cls, model_cls = _tiny_architectures()[cfg.architecture]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = {"rope_type": "default", "mrope_section": _mrope_section(head_dim), "rope_theta": 10000.0}
    if cfg.architecture == "qwen3_vl":
        rope["mrope_interleaved"] = True
    text = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=rope,
        bos_token_id=token_ids["eos"],
        eos_token_id=token_ids["eos"],
        pad_token_id=token_ids["eos"],
    )
    vision = dict(
        depth=cfg.vision_depth,
        hidden_size=cfg.vision_hidden_size,
        intermediate_size=cfg.vision_intermediate_size,
        num_heads=cfg.vision_num_heads,
        out_hidden_size=cfg.hidden_size,
        patch_size=cfg.patch_size,
        spatial_merge_size=cfg.spatial_merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
    )
    if cfg.architecture == "qwen2_5_vl":
        vision.update(fullatt_block_indexes=[cfg.vision_depth - 1], window_size=cfg.patch_size * 4)
    else:
        vision.update(deepstack_visual_indexes=[], num_position_embeddings=64)
    config = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=token_ids[IMAGE_PAD],
        video_token_id=token_ids[VIDEO_PAD],
        vision_start_token_id=token_ids[VISION_START],
        vision_end_token_id=token_ids[VISION_END],
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return model_cls(config)


def tiny_image_processor(cfg: TinyVLMConfig) -> Any:
    """The Qwen2-VL image processor (PIL backend when torchvision is absent) at the tiny sizes."""
    try:
        import torchvision  # noqa: F401
        from transformers import Qwen2VLImageProcessor as processor_cls
    except ImportError:
        from transformers import Qwen2VLImageProcessorPil as processor_cls
    return processor_cls(
        patch_size=cfg.patch_size,
        merge_size=cfg.spatial_merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
    )


class VLMBundle(CausalLMBundle):
    """A vision-language causal LM, its tokenizer and its image processor.

    Attributes (beyond `CausalLMBundle`'s):
        image_processor: turns PIL images into `pixel_values` [N, D] and
            `image_grid_thw` [k, 3].
        merge: patches per LM token along each side (the vision tower's spatial merge).
        image_token_id: the placeholder token one image position takes in the prompt.
        vision_token_ids: the image / video placeholders and vision start / end tokens, which
            `CausalLMStage.generate` never samples (a response holding one would be read as an
            image slot on replay).
    """

    has_vision: ClassVar[bool] = True
    auto_model: ClassVar[type] = AutoModelForImageTextToText

    def __init__(self, model: PreTrainedModel, tokenizer: Any, image_processor: Any, where: str) -> None:
        super().__init__(model, tokenizer, where)
        config = model.config
        self.image_processor = image_processor
        self.merge: int = config.vision_config.spatial_merge_size
        self.image_token_id: int = config.image_token_id
        for token in (VISION_START, IMAGE_PAD, VISION_END):
            ids = tokenizer.encode(token, add_special_tokens=False)
            if len(ids) != 1:
                raise ValueError(f"{where}: the tokenizer does not hold {token!r} as one token (got {ids})")
        # the placeholders a response must never hold (the stage does not sample them)
        self.vision_token_ids: tuple[int, ...] = tuple(
            i
            for i in (
                config.image_token_id,
                getattr(config, "video_token_id", None),
                getattr(config, "vision_start_token_id", None),
                getattr(config, "vision_end_token_id", None),
            )
            if i is not None
        )
        if tokenizer.convert_tokens_to_ids(IMAGE_PAD) != self.image_token_id:
            raise ValueError(
                f"{where}: the tokenizer's {IMAGE_PAD} is id {tokenizer.convert_tokens_to_ids(IMAGE_PAD)} but "
                f"config.json's image_token_id is {self.image_token_id}; use the tokenizer saved with this model"
            )

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32) -> VLMBundle:
        """Load a local VLM directory (weights, tokenizer and processor files), never the hub."""
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise FileNotFoundError(
                f"model.pretrained_path {path!r} has no config.json: not a Hugging Face model directory"
            )
        from transformers import AutoImageProcessor

        model = cls.auto_model.from_pretrained(path, dtype=dtype, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        image_processor = AutoImageProcessor.from_pretrained(path, local_files_only=True)
        return cls(model, tokenizer, image_processor, where=f"model.pretrained_path {path!r}")

    @classmethod
    def tiny(cls, cfg: TinyVLMConfig, dtype: torch.dtype = torch.float32) -> VLMBundle:
        tokenizer = tiny_tokenizer(extra_special=VISION_TOKENS)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
        ids["eos"] = tokenizer.eos_token_id
        model = tiny_vlm_model(cfg, len(tokenizer), ids).to(dtype)
        return cls(model, tokenizer, tiny_image_processor(cfg), where="model.tiny")

    def save_pretrained(self, path: str) -> None:
        """Model, tokenizer and image processor (`VLMConfig(pretrained_path=path)` reads them back)."""
        super().save_pretrained(path)
        self.image_processor.save_pretrained(path)

    # ---- images -----------------------------------------------------------------------------
    def prepare(
        self, prompt: str, images: list[Any], sample_id: str
    ) -> tuple[str, torch.Tensor, torch.Tensor]:
        """(prompt with each `<image>` replaced by its vision tokens, pixel values [N, D] fp32,
        grids [k, 3] long) of one sample with k = len(images) images; placeholders and images
        must agree in number."""
        n_marks = prompt.count(IMAGE_PLACEHOLDER)
        if n_marks != len(images):
            raise ValueError(
                f"sample {sample_id!r}: the prompt has {n_marks} {IMAGE_PLACEHOLDER} placeholder(s) but the "
                f"row carries {len(images)} image(s) (metadata['images']); give one placeholder per image"
            )
        if not images:
            return prompt, torch.zeros(0, self.patch_dim), torch.zeros(0, 3, dtype=torch.long)
        pil = [load_image(im, sample_id, i) for i, im in enumerate(images)]
        out = self.image_processor(images=pil, return_tensors="pt")
        grids = out["image_grid_thw"].long()
        parts = prompt.split(IMAGE_PLACEHOLDER)
        text = parts[0]
        for grid, tail in zip(grids, parts[1:], strict=True):
            text += VISION_START + IMAGE_PAD * (int(grid.prod()) // self.merge**2) + VISION_END + tail
        return text, out["pixel_values"].float(), grids

    @property
    def patch_dim(self) -> int:
        """D: the flattened patch length, channels * temporal_patch * patch * patch."""
        v = self.model.config.vision_config
        return getattr(v, "in_channels", 3) * v.temporal_patch_size * v.patch_size**2

    def positions(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> torch.Tensor:
        """[3, B, L] multimodal rotary positions of a padded batch (padding: 0)."""
        types = (input_ids == self.image_token_id).int()
        positions, _ = self.model.model.get_rope_index(
            input_ids, types, image_grid_thw=image_grid_thw, attention_mask=attention_mask
        )
        return positions

    @staticmethod
    def vision_inputs(pixel_values: list[torch.Tensor], image_grid_thw: list[torch.Tensor], device) -> dict:
        """The forward's image arguments for a batch (rows in batch order), or {} without images."""
        if sum(int(g.shape[0]) for g in image_grid_thw) == 0:
            return {}
        return {
            "pixel_values": torch.cat(list(pixel_values)).to(device),
            "image_grid_thw": torch.cat(list(image_grid_thw)).to(device),
        }


def is_vlm_directory(path: str) -> bool | None:
    """Whether `path/config.json` describes a vision-language model (it has a `vision_config`);
    None when there is no readable config.json."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return "vision_config" in json.load(f)
    except (OSError, ValueError):
        return None


@dataclass
class VLMConfig:
    """Which vision-language model to build (exactly one of `pretrained_path` / `tiny`).

    Attributes:
        pretrained_path: a local Hugging Face VLM directory (Qwen2.5-VL, Qwen3-VL).
        tiny: tiny-model config used when `pretrained_path` is null.
        dtype: parameter dtype ("float32", "bfloat16", "float16").
    """

    modality: ClassVar[str] = "text"

    pretrained_path: str | None = None
    tiny: TinyVLMConfig | None = None
    dtype: DType = "float32"

    def __post_init__(self) -> None:
        check_source(self, TinyVLMConfig, "VLM", exclusive=True)

    def trainable_on_meta(self) -> torch.nn.Module:
        """The VLM's module tree on the meta device (no weights read)."""
        return model_on_meta(
            self.pretrained_path,
            AutoModelForImageTextToText.from_config,
            lambda: VLMBundle.tiny(self.tiny).model,
        )

    def build(self) -> VLMBundle:
        if self.pretrained_path is not None:
            return VLMBundle.from_pretrained(self.pretrained_path, dtype=DTYPES[self.dtype])
        return VLMBundle.tiny(self.tiny, dtype=DTYPES[self.dtype])

    def load_checkpoint(self, path: str) -> VLMBundle:
        """The bundle of a UniRL checkpoint of a VLM run, fp32."""
        from unirl.models.causal_lm.bundle import load_checkpoint

        return load_checkpoint(path, bundle_cls=VLMBundle)

    def directory_problems(self) -> list[str]:
        """`pretrained_path`, when set, is a directory holding a vision-language model."""
        path = self.pretrained_path
        problems = missing_directory_problems(path, "Hugging Face VLM (Qwen2.5-VL / Qwen3-VL)")
        if problems or not path:
            return problems
        if is_vlm_directory(path) is False:
            return [
                f"model.pretrained_path: {path!r} holds a text-only model (its config.json has no vision_config) "
                "but model._target_ is unirl.models.causal_lm.VLMConfig; use "
                "unirl.models.causal_lm.CausalLMConfig for a text-only model"
            ]
        return []
