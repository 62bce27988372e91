"""The Qwen bundle: a transformers causal LM (Qwen3 / Qwen2) and its tokenizer.

Two ways to build one, same code path afterwards:
- `QwenBundle.from_pretrained(dir)`: a local Hugging Face directory (`config.json`, weights,
  tokenizer files), read with `local_files_only`;
- `QwenBundle.tiny(TinyLMConfig(...))`: a tiny random Qwen3 / Qwen2 built from a config, with the
  byte-level tokenizer built in code (no files, no hub).

`save_pretrained(dir)` writes model and tokenizer so that `AutoModelForCausalLM.from_pretrained(dir)`
and `AutoTokenizer.from_pretrained(dir)` (or `QwenConfig(pretrained_path=dir)`) load them back
offline. Everything else (checks, LoRA / full export, supervised batches) is `TextBundle`'s.
"""

from __future__ import annotations

import torch

from unirl.models.causal_lm.family import TextBundle
from unirl.models.causal_lm.loading import load_checkpoint as load_text_checkpoint
from unirl.models.causal_lm.tiny import TinyLMConfig, tiny_lm_model, tiny_tokenizer


class QwenBundle(TextBundle):
    """A Qwen3 / Qwen2 causal LM and its tokenizer (a `unirl.models.causal_lm.family.TextFamily`)."""

    @classmethod
    def tiny(cls, cfg: TinyLMConfig, dtype: torch.dtype = torch.float32) -> QwenBundle:
        """A randomly initialized tiny LM, deterministic in `cfg.seed`."""
        tokenizer = tiny_tokenizer()
        return cls(tiny_lm_model(cfg, tokenizer, dtype), tokenizer, where="model.tiny")


def load_checkpoint(path: str, dtype: torch.dtype = torch.float32) -> QwenBundle:
    """The bundle of a UniRL checkpoint of a Qwen run: its base model with the trained weights
    (a LoRA adapter merged, or the full model) (`unirl.models.causal_lm.loading.load_checkpoint`)."""
    return load_text_checkpoint(path, QwenBundle, dtype)
