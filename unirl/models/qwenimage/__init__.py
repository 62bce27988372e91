"""Qwen-Image model family: the bundle (a `FlowFamily`), its model config and tiny builders.

`QwenImageStage` is the shared `FlowMatchingStage` under the name Qwen-Image recipes give their stage."""

from unirl.models.flow.stage import FlowMatchingStage as QwenImageStage
from unirl.models.qwenimage.bundle import QwenImageBundle, load_checkpoint
from unirl.models.qwenimage.config import LORA_TARGETS, QwenImageModelConfig, TinyQwenImageConfig

__all__ = [
    "LORA_TARGETS",
    "QwenImageBundle",
    "QwenImageModelConfig",
    "QwenImageStage",
    "TinyQwenImageConfig",
    "load_checkpoint",
]
