"""The Qwen-VL family's model config (Qwen2.5-VL / Qwen3-VL through transformers): which model to
build, as data. It names its modeling module (`bundle.py`) only inside the calls that build.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from unirl.models.causal_lm.loading import TransformersFamilyConfig, is_vlm_directory
from unirl.models.causal_lm.tiny import TinyVLMConfig
from unirl.models.source import missing_directory_problems


@dataclass
class QwenVLConfig(TransformersFamilyConfig):
    """Which vision-language model to build (exactly one of `pretrained_path` / `tiny`).

    Attributes:
        pretrained_path: a local Hugging Face VLM directory (Qwen2.5-VL, Qwen3-VL).
    """

    modality: ClassVar[str] = "text"
    vision: ClassVar[bool] = True  # prompts may carry images
    MODELING: ClassVar[str] = "unirl.models.qwen_vl.bundle"
    BUNDLE: ClassVar[str] = "QwenVLBundle"
    TINY: ClassVar[type] = TinyVLMConfig
    WHAT: ClassVar[str] = "VLM"
    MODEL_CLASS: ClassVar[str] = "AutoModelForImageTextToText"

    tiny: TinyVLMConfig | None = None

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
