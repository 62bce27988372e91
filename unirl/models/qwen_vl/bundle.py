"""The Qwen-VL bundle: a vision-language causal LM (Qwen2.5-VL, Qwen3-VL through transformers), its
tokenizer and its image processor.

A VLM is a causal LM whose prompt may hold images. The text stage
(`CausalLMStage`) drives it unchanged except for three things this module
supplies through `QwenVLBundle`:
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
- `QwenVLConfig(pretrained_path=<dir>)`: a local Hugging Face VLM directory (its
  `config.json` has a `vision_config`; processor files beside the weights);
- `QwenVLConfig(tiny=TinyVLMConfig(...))`: a tiny random Qwen2.5-VL or Qwen3-VL from a
  config (`unirl.models.causal_lm.tiny`), with the byte-level tokenizer plus the vision tokens and the family's
  image processor (the PIL backend when torchvision is absent), all built in code.
"""

from __future__ import annotations

import os
from typing import Any, ClassVar

import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer, PreTrainedModel

from unirl.models.causal_lm.family import IMAGE_PLACEHOLDER, TextBundle
from unirl.models.causal_lm.loading import load_checkpoint as load_text_checkpoint
from unirl.models.causal_lm.tiny import (
    IMAGE_PAD,
    VISION_END,
    VISION_START,
    VISION_TOKENS,
    TinyVLMConfig,
    tiny_image_processor,
    tiny_tokenizer,
    tiny_vlm_model,
)
from unirl.models.images import load_image


class QwenVLBundle(TextBundle):
    """A vision-language causal LM, its tokenizer and its image processor.

    Attributes (beyond `TextBundle`'s):
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
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32) -> QwenVLBundle:
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
    def tiny(cls, cfg: TinyVLMConfig, dtype: torch.dtype = torch.float32) -> QwenVLBundle:
        tokenizer = tiny_tokenizer(extra_special=VISION_TOKENS)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in VISION_TOKENS}
        ids["eos"] = tokenizer.eos_token_id
        model = tiny_vlm_model(cfg, len(tokenizer), ids).to(dtype)
        return cls(model, tokenizer, tiny_image_processor(cfg), where="model.tiny")

    def save_pretrained(self, path: str) -> None:
        """Model, tokenizer and image processor (`QwenVLConfig(pretrained_path=path)` reads them back)."""
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


def load_checkpoint(path: str, dtype: torch.dtype = torch.float32) -> QwenVLBundle:
    """The bundle of a UniRL checkpoint of a Qwen-VL run (`unirl.models.causal_lm.loading.load_checkpoint`)."""
    return load_text_checkpoint(path, QwenVLBundle, dtype)
