"""Causal-LM model family (Qwen2 / Qwen3, and the Qwen2.5-VL / Qwen3-VL vision-language models,
through transformers): bundles, the text stage, tiny builders."""

from unirl.models.causal_lm.bundle import (
    CausalLMBundle,
    CausalLMConfig,
    TinyLMConfig,
    load_checkpoint,
    tiny_tokenizer,
)
from unirl.models.causal_lm.stage import CausalLMStage
from unirl.models.causal_lm.vision import TinyVLMConfig, VLMBundle, VLMConfig

__all__ = [
    "CausalLMBundle",
    "CausalLMConfig",
    "CausalLMStage",
    "TinyLMConfig",
    "TinyVLMConfig",
    "VLMBundle",
    "VLMConfig",
    "load_checkpoint",
    "tiny_tokenizer",
]
