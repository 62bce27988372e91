"""The Qwen-VL family's model config (Qwen2.5-VL / Qwen3-VL through transformers): which model to
build, as data. It names its modeling module (`bundle.py`) only inside the calls that build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from unirl.models.causal_lm.loading import is_vlm_directory, model_on_meta
from unirl.models.causal_lm.tiny import TinyVLMConfig
from unirl.models.source import DTYPES, DType, check_source, missing_directory_problems


@dataclass
class QwenVLConfig:
    """Which vision-language model to build (exactly one of `pretrained_path` / `tiny`).

    Attributes:
        pretrained_path: a local Hugging Face VLM directory (Qwen2.5-VL, Qwen3-VL).
        tiny: tiny-model config used when `pretrained_path` is null.
        dtype: parameter dtype ("float32", "bfloat16", "float16").
    """

    modality: ClassVar[str] = "text"
    vision: ClassVar[bool] = True  # prompts may carry images

    pretrained_path: str | None = None
    tiny: TinyVLMConfig | None = None
    dtype: DType = "float32"

    def __post_init__(self) -> None:
        check_source(self, TinyVLMConfig, "VLM", exclusive=True)

    def trainable_on_meta(self) -> torch.nn.Module:
        """The VLM's module tree on the meta device (no weights read)."""
        from transformers import AutoModelForImageTextToText

        from unirl.models.qwen_vl.bundle import QwenVLBundle

        return model_on_meta(
            self.pretrained_path,
            AutoModelForImageTextToText.from_config,
            lambda: QwenVLBundle.tiny(self.tiny).model,
        )

    def build(self) -> Any:
        """The `QwenVLBundle` (`bundle.py`)."""
        from unirl.models.qwen_vl.bundle import QwenVLBundle

        if self.pretrained_path is not None:
            return QwenVLBundle.from_pretrained(self.pretrained_path, dtype=DTYPES[self.dtype])
        return QwenVLBundle.tiny(self.tiny, dtype=DTYPES[self.dtype])

    def load_checkpoint(self, path: str) -> Any:
        """The bundle of a UniRL checkpoint of a Qwen-VL run, fp32 (`bundle.load_checkpoint`)."""
        from unirl.models.qwen_vl.bundle import load_checkpoint

        return load_checkpoint(path)

    def directory_problems(self) -> list[str]:
        """`pretrained_path`, when set, is a directory holding a vision-language model."""
        path = self.pretrained_path
        problems = missing_directory_problems(path, "Hugging Face VLM (Qwen2.5-VL / Qwen3-VL)")
        if problems or not path:
            return problems
        if is_vlm_directory(path) is False:
            return [
                f"model.pretrained_path: {path!r} holds a text-only model (its config.json has no vision_config) "
                "but model._target_ is unirl.models.qwen_vl.QwenVLConfig; use "
                "unirl.models.qwen.QwenConfig for a text-only model"
            ]
        return []
