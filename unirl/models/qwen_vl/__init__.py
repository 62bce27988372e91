"""The Qwen-VL family (Qwen2.5-VL / Qwen3-VL vision-language models through transformers) on the
shared text stage (`unirl.models.causal_lm.CausalLMStage`, a `VisionTextFamily`): its model config
(`config.py`) and its bundle (`bundle.py`). The tiny models are `unirl.models.causal_lm.tiny`'s."""

from unirl.models.causal_lm.tiny import TinyVLMConfig
from unirl.models.qwen_vl.bundle import QwenVLBundle, load_checkpoint
from unirl.models.qwen_vl.config import QwenVLConfig

__all__ = ["QwenVLBundle", "QwenVLConfig", "TinyVLMConfig", "load_checkpoint"]
