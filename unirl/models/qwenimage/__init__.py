"""Qwen-Image model family (and Qwen-Image-Edit-Plus, its editing model: `edit.py`): the bundle (a `FlowFamily`), its model config and tiny builders.

`QwenImageStage` is the shared `FlowMatchingStage` under the name Qwen-Image recipes give their stage."""

from unirl.models.flow.stage import FlowMatchingStage as QwenImageStage
from unirl.models.qwenimage.bundle import QwenImageBundle, load_checkpoint
from unirl.models.qwenimage.config import (
    LORA_TARGETS,
    QwenImageEditPlusModelConfig,
    QwenImageModelConfig,
    TinyQwenImageConfig,
    TinyQwenImageEditConfig,
)
from unirl.models.qwenimage.edit import QwenImageEditPlusBundle

__all__ = [
    "LORA_TARGETS",
    "QwenImageBundle",
    "QwenImageEditPlusBundle",
    "QwenImageEditPlusModelConfig",
    "QwenImageModelConfig",
    "QwenImageStage",
    "TinyQwenImageConfig",
    "TinyQwenImageEditConfig",
    "load_checkpoint",
]
