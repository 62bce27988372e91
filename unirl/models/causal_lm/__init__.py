"""The shared text stage (`CausalLMStage`) over any text family (`family.TextFamily`; the
transformers plumbing of a family's bundle: `family.TextBundle`), what the families share to load
(`loading.py`) and the tiny models built in code (`tiny.py`). The families are packages of their
own: `unirl.models.qwen`, `unirl.models.qwen_vl`, `unirl.models.janus`."""

from unirl.models.causal_lm.family import IMAGE_PLACEHOLDER, TextBundle, TextFamily, VisionTextFamily
from unirl.models.causal_lm.stage import CausalLMStage
from unirl.models.causal_lm.tiny import TinyLMConfig, TinyVLMConfig, tiny_tokenizer

__all__ = [
    "IMAGE_PLACEHOLDER",
    "CausalLMStage",
    "TextBundle",
    "TextFamily",
    "TinyLMConfig",
    "TinyVLMConfig",
    "VisionTextFamily",
    "tiny_tokenizer",
]
