"""The Qwen family's model config (Qwen3 / Qwen2 causal LMs through transformers): which model to
build, as data. It names its modeling module (`bundle.py`) only inside the calls that build, and
answers the validator's questions (module names on the meta device, the directory) itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from unirl.models.causal_lm.loading import is_vlm_directory, model_on_meta
from unirl.models.causal_lm.tiny import TinyLMConfig, tiny_lm_model, tiny_tokenizer
from unirl.models.source import DTYPES, DType, check_source, missing_directory_problems


@dataclass
class QwenConfig:
    """Which Qwen3 / Qwen2 causal LM to build (exactly one of `pretrained_path` / `tiny`).

    Attributes:
        pretrained_path: local Hugging Face directory of a causal LM and its tokenizer.
        tiny: tiny-model config used when `pretrained_path` is null.
        dtype: parameter dtype of the model ("float32", "bfloat16", "float16").
    """

    modality: ClassVar[str] = "text"
    vision: ClassVar[bool] = False  # prompts carry no images (a vLLM engine serves it)

    pretrained_path: str | None = None
    tiny: TinyLMConfig | None = None
    dtype: DType = "float32"

    def __post_init__(self) -> None:
        check_source(self, TinyLMConfig, "causal-LM", exclusive=True)

    def trainable_on_meta(self) -> torch.nn.Module:
        """The LM's module tree on the meta device (no weights read): for validators
        that check names (FSDP blocks, LoRA targets) before any work starts."""
        from transformers import AutoModelForCausalLM

        return model_on_meta(
            self.pretrained_path,
            AutoModelForCausalLM.from_config,
            lambda: tiny_lm_model(self.tiny, tiny_tokenizer()),
        )

    def build(self) -> Any:
        """The `QwenBundle` (`bundle.py`)."""
        from unirl.models.qwen.bundle import QwenBundle

        if self.pretrained_path is not None:
            return QwenBundle.from_pretrained(self.pretrained_path, dtype=DTYPES[self.dtype])
        return QwenBundle.tiny(self.tiny, dtype=DTYPES[self.dtype])

    def load_checkpoint(self, path: str) -> Any:
        """The bundle of a UniRL checkpoint of a Qwen run, fp32 (`bundle.load_checkpoint`)."""
        from unirl.models.qwen.bundle import load_checkpoint

        return load_checkpoint(path)

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
