"""A CLIP model and its processor from local directories: what the CLIP-based scorers share
(`PickScore`, `AestheticScore`).

The directories are in the upstream layout: a transformers `CLIPModel` (`config.json` and
`model.safetensors` or `pytorch_model.bin`) and a `CLIPProcessor` (`preprocessor_config.json`
as on the hub, or transformers 5's `processor_config.json`, and the tokenizer files). Missing
files are named when the backbone is made (scorers make it in their constructors, so a recipe
that points at a wrong directory fails validation before Ray); the model loads on first use.
Without torchvision transformers runs the processor's PIL backend (`CLIPImageProcessorPil`).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch

from unirl.reward.placement import on_device_while_scoring

WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
DTYPES = ("float32", "bfloat16", "float16")


def missing_files(model_path: str, processor_path: str, weights: bool = True) -> list[str]:
    """What a CLIP checkpoint and its processor lack, named by path ([] when complete); without
    `weights` the directory need not hold weight files (they come from elsewhere)."""
    missing = []
    if not os.path.isfile(os.path.join(model_path, "config.json")):
        missing.append(os.path.join(model_path, "config.json"))
    if weights and not any(os.path.isfile(os.path.join(model_path, w)) for w in WEIGHT_FILES):
        missing.append(f"{model_path}/{' or '.join(WEIGHT_FILES)}")
    if not any(os.path.isfile(os.path.join(processor_path, name)) for name in PROCESSOR_FILES):
        missing.append(f"{processor_path}/{' or '.join(PROCESSOR_FILES)}")
    return missing


def features(out: Any) -> torch.Tensor:
    """The projected embedding `get_image_features` / `get_text_features` return: a tensor
    (transformers 4) or the `pooler_output` of their output (transformers 5)."""
    return out if isinstance(out, torch.Tensor) else out.pooler_output


class ClipBackbone:
    """A `CLIPModel` and its `CLIPProcessor`, giving unit-norm embeddings of images and texts.

    Args:
        owner: the scorer's name, for its errors.
        model_path, processor_path: local directories (processor_path None: model_path).
        device, dtype: where and in what precision the model runs.
        what: what the directories should hold, for the missing-files error.
        batch_size: samples per forward of `images` / `cosines`.
        offload: keep the model in host memory between calls and move it to `device` only for
            one (`on_device`), so a scorer colocated with the rollout gives its accelerator
            memory back between scorings (CUDA's cache is emptied after the move back).
        state_dict: a callable giving the model's weights (transformers names) when they are not
            in `model_path` (then only its `config.json` is read), e.g. a converted open_clip
            checkpoint; called once, on first use; loaded strictly.
    """

    def __init__(
        self,
        owner: str,
        model_path: str,
        processor_path: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        what: str = "",
        batch_size: int = 16,
        offload: bool = False,
        state_dict: Callable[[], dict[str, torch.Tensor]] | None = None,
    ) -> None:
        self.model_path, self.processor_path = str(model_path), str(processor_path or model_path)
        self.state_dict = state_dict
        missing = missing_files(self.model_path, self.processor_path, weights=state_dict is None)
        if missing:
            raise ValueError(
                f"{owner}: missing {missing}; model_path is a transformers CLIPModel directory and "
                f"processor_path its CLIPProcessor{what}"
            )
        if dtype not in DTYPES:
            raise ValueError(f"{owner} dtype must be one of {list(DTYPES)}, got {dtype!r}")
        if batch_size < 1:
            raise ValueError(f"{owner} batch_size must be >= 1, got {batch_size}")
        self.device, self.dtype = torch.device(device), getattr(torch, dtype)
        self.batch_size = int(batch_size)
        self.offload = bool(offload)
        self._active = 0
        self._model: Any = None
        self._processor: Any = None

    def load(self) -> tuple[Any, Any]:
        """(model, processor), loaded on first use."""
        if self._model is None:
            from transformers import CLIPConfig, CLIPModel, CLIPProcessor

            self._processor = CLIPProcessor.from_pretrained(self.processor_path)
            if self.state_dict is None:
                model = CLIPModel.from_pretrained(self.model_path, torch_dtype=self.dtype)
            else:
                model = CLIPModel(CLIPConfig.from_pretrained(self.model_path))
                model.load_state_dict(self.state_dict(), strict=True)
                model = model.to(self.dtype)
            home = "cpu" if self.offload and not self._active else self.device
            self._model = model.eval().requires_grad_(False).to(home)
        return self._model, self._processor

    @contextmanager
    def on_device(self, *modules: torch.nn.Module):
        """The model (and `modules`, e.g. a head on the embeddings) on `device` inside the block;
        with `offload`, back in host memory after the outermost block."""
        outermost = self._active == 0
        self._active += 1
        try:
            with on_device_while_scoring(self.device, self.offload and outermost, self.load()[0], *modules):
                yield
        finally:
            self._active -= 1

    @property
    def logit_scale(self) -> torch.Tensor:
        """exp(the model's logit scale), on `device`."""
        return self.load()[0].logit_scale.exp().to(self.device)

    @torch.no_grad()
    def image_embeddings(self, images: torch.Tensor) -> torch.Tensor:
        """[B, D] unit-norm embeddings of `images` ([B, 3, H, W] uint8 RGB), through the processor."""
        from PIL import Image

        model, processor = self.load()
        pil = [Image.fromarray(im.permute(1, 2, 0).numpy()) for im in images.cpu()]
        pixels = processor(images=pil, return_tensors="pt")["pixel_values"].to(self.device, self.dtype)
        emb = features(model.get_image_features(pixel_values=pixels))
        return emb / emb.norm(dim=-1, keepdim=True)

    @torch.no_grad()
    def text_embeddings(self, texts: list[str]) -> torch.Tensor:
        """[B, D] unit-norm embeddings of `texts`, padded and truncated to 77 tokens."""
        model, processor = self.load()
        inputs = processor(text=texts, padding=True, truncation=True, max_length=77, return_tensors="pt")
        emb = features(model.get_text_features(**{k: v.to(self.device) for k, v in inputs.items()}))
        return emb / emb.norm(dim=-1, keepdim=True)

    def images(self, images: torch.Tensor) -> torch.Tensor:
        """[B, D] unit-norm embeddings of `images`, `batch_size` at a time."""
        with self.on_device():
            return torch.cat(
                [
                    self.image_embeddings(images[i : i + self.batch_size])
                    for i in range(0, len(images), self.batch_size)
                ]
            )

    def cosines(self, images: torch.Tensor, texts: list[str]) -> torch.Tensor:
        """[B] cosine of each image's embedding and its text's, `batch_size` pairs at a time."""
        with self.on_device():
            return torch.cat(
                [
                    (
                        self.text_embeddings(texts[i : i + self.batch_size])
                        * self.image_embeddings(images[i : i + self.batch_size])
                    ).sum(dim=-1)
                    for i in range(0, len(texts), self.batch_size)
                ]
            )
