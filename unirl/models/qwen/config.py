"""The Qwen family's model config (Qwen3 / Qwen2 causal LMs through transformers): which model to
build, as data. It names its modeling module (`bundle.py`) only inside the calls that build, and
answers the validator's questions (module names on the meta device, the directory) itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from unirl.models.causal_lm.loading import TransformersFamilyConfig, is_vlm_directory
from unirl.models.causal_lm.tiny import TinyLMConfig
from unirl.models.source import missing_directory_problems


@dataclass
class QwenConfig(TransformersFamilyConfig):
    """Which Qwen3 / Qwen2 causal LM to build (exactly one of `pretrained_path` / `tiny`).

    Attributes:
        pretrained_path: local Hugging Face directory of a causal LM and its tokenizer.
    """

    modality: ClassVar[str] = "text"
    vision: ClassVar[bool] = False  # prompts carry no images (a vLLM engine serves it)
    MODELING: ClassVar[str] = "unirl.models.qwen.bundle"
    BUNDLE: ClassVar[str] = "QwenBundle"
    TINY: ClassVar[type] = TinyLMConfig
    WHAT: ClassVar[str] = "causal-LM"
    MODEL_CLASS: ClassVar[str] = "AutoModelForCausalLM"

    tiny: TinyLMConfig | None = None

    def directory_problems(self) -> list[str]:
        """`pretrained_path`, when set, is a directory (its files are checked when read)."""
        path = self.pretrained_path
        problems = missing_directory_problems(path, "Hugging Face causal-LM (Qwen3 / Qwen2)")
        if problems or not path:
            return problems
        if is_vlm_directory(path):
            return [
                f"model.pretrained_path: {path!r} holds a vision-language model (its config.json has a "
                "vision_config) but model._target_ is unirl.models.qwen.QwenConfig; use "
                "unirl.models.qwen_vl.QwenVLConfig"
            ]
        return []
