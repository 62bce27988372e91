"""Causal-LM model family (Qwen2 / Qwen3 through transformers): bundle, text stage, tiny builders."""

from unirl.models.causal_lm.bundle import (
    CausalLMBundle,
    CausalLMConfig,
    TinyLMConfig,
    load_checkpoint,
    tiny_tokenizer,
)
from unirl.models.causal_lm.stage import CausalLMStage

__all__ = [
    "CausalLMBundle",
    "CausalLMConfig",
    "CausalLMStage",
    "TinyLMConfig",
    "load_checkpoint",
    "tiny_tokenizer",
]
