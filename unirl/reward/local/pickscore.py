"""PickScore (Kirstain et al. 2023), the reward of Flow-GRPO's PickScore runs, from local directories.

A PickScore checkpoint is a transformers `CLIPModel` (the hub's `yuvalkirstain/PickScore_v1`
layout: `config.json` and `model.safetensors` or `pytorch_model.bin`) and the `CLIPProcessor` of
the CLIP it was tuned from (`laion/CLIP-ViT-H-14-laion2B-s32B-b79K`: `preprocessor_config.json`
and its tokenizer files). A sample's score is Flow-GRPO's `flow_grpo/pickscore_scorer.py`:
`logit_scale.exp() * cos(text embedding, image embedding) * scale`, with `scale` 1/26 there (a
score near 1 for a good match), each embedding from `get_text_features` / `get_image_features`
of the processor's inputs (images resized and centre-cropped by the processor, prompts padded and
truncated to 77 tokens). Without torchvision transformers picks the processor's PIL backend
(`CLIPImageProcessorPil`), which is what runs here.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from unirl.types.reward import RewardRequest

MODEL_FILES = ("config.json",)
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
# the image processor's settings: the hub's layout (transformers 4) or transformers 5's processor file
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")


def missing_files(model_path: str, processor_path: str) -> list[str]:
    """What a PickScore checkpoint and its processor lack, named by path ([] when complete)."""
    missing = []
    for name in MODEL_FILES:
        if not os.path.isfile(os.path.join(model_path, name)):
            missing.append(os.path.join(model_path, name))
    if not any(os.path.isfile(os.path.join(model_path, w)) for w in WEIGHT_FILES):
        missing.append(f"{model_path}/{' or '.join(WEIGHT_FILES)}")
    if not any(os.path.isfile(os.path.join(processor_path, name)) for name in PROCESSOR_FILES):
        missing.append(f"{processor_path}/{' or '.join(PROCESSOR_FILES)}")
    return missing


def features(out: Any) -> torch.Tensor:
    """The projected embedding `get_image_features` / `get_text_features` return: a tensor
    (transformers 4) or the `pooler_output` of their output (transformers 5)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class PickScore:
    """Scorer: PickScore of each image against its prompt, [B] fp32.

    Args:
        model_path: local directory of the PickScore `CLIPModel`.
        processor_path: local directory of its `CLIPProcessor` (None: `model_path`).
        scale: multiplies `logit_scale.exp() * cos` (Flow-GRPO's 1/26; 1.0 gives PickScore's raw
            logit, about 20-23 for real images).
        batch_size: images per forward.
        device, dtype: where and in what precision the model runs (loaded on the first call).

    Missing files are a `ValueError` naming each path when the scorer is built (before Ray, as
    the recipe validator builds reward components).
    """

    def __init__(
        self,
        model_path: str,
        processor_path: str | None = None,
        scale: float = 1.0 / 26.0,
        batch_size: int = 16,
        device: str = "cpu",
        dtype: str = "float32",
    ) -> None:
        self.model_path, self.processor_path = str(model_path), str(processor_path or model_path)
        missing = missing_files(self.model_path, self.processor_path)
        if missing:
            raise ValueError(
                f"PickScore: missing {missing}; model_path is a transformers CLIPModel directory "
                "(yuvalkirstain/PickScore_v1's files) and processor_path its CLIPProcessor "
                "(laion/CLIP-ViT-H-14-laion2B-s32B-b79K's preprocessor and tokenizer files)"
            )
        if batch_size < 1:
            raise ValueError(f"PickScore batch_size must be >= 1, got {batch_size}")
        if dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"PickScore dtype must be float32, bfloat16 or float16, got {dtype!r}")
        self.scale, self.batch_size = float(scale), int(batch_size)
        self.device, self.dtype = torch.device(device), getattr(torch, dtype)
        self._model: Any = None
        self._processor: Any = None

    def load(self) -> tuple[Any, Any]:
        """(model, processor), loaded on first use."""
        if self._model is None:
            from transformers import CLIPModel, CLIPProcessor

            self._processor = CLIPProcessor.from_pretrained(self.processor_path)
            model = CLIPModel.from_pretrained(self.model_path, torch_dtype=self.dtype)
            self._model = model.eval().requires_grad_(False).to(self.device)
        return self._model, self._processor

    @torch.no_grad()
    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images` ([B, 3, H, W] uint8) against `req.prompts`."""
        from PIL import Image

        images = req.require_images("PickScore").cpu()
        model, processor = self.load()
        scores = []
        for start in range(0, len(req), self.batch_size):
            batch = images[start : start + self.batch_size]
            pil = [Image.fromarray(im.permute(1, 2, 0).numpy()) for im in batch]
            prompts = req.prompts[start : start + self.batch_size]
            image_in = processor(images=pil, return_tensors="pt")
            text_in = processor(text=prompts, padding=True, truncation=True, max_length=77, return_tensors="pt")
            image_emb = features(model.get_image_features(pixel_values=image_in["pixel_values"].to(self.device, self.dtype)))
            text_emb = features(model.get_text_features(**{k: v.to(self.device) for k, v in text_in.items()}))
            image_emb = image_emb / image_emb.norm(dim=-1, keepdim=True)
            text_emb = text_emb / text_emb.norm(dim=-1, keepdim=True)
            cos = (text_emb * image_emb).sum(dim=-1)
            scores.append((model.logit_scale.exp() * cos * self.scale).float().cpu())
        return torch.cat(scores)
