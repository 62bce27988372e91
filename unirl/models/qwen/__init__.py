"""The Qwen family (Qwen3 / Qwen2 causal LMs through transformers) on the shared text stage
(`unirl.models.causal_lm.CausalLMStage`): its model config (`config.py`), its bundle
(`bundle.py`) and its critic (`value.py`). The tiny models are `unirl.models.causal_lm.tiny`'s."""

from unirl.models.causal_lm.tiny import TinyLMConfig
from unirl.models.qwen.bundle import QwenBundle, load_checkpoint
from unirl.models.qwen.config import QwenConfig
from unirl.models.qwen.value import QwenValueConfig

__all__ = ["QwenBundle", "QwenConfig", "QwenValueConfig", "TinyLMConfig", "load_checkpoint"]
