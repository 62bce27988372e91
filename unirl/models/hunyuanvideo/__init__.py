"""HunyuanVideo 1.5 model family (text-to-video, and image-to-video in `i2v.py`): the bundle (a
`FlowFamily`), its model configs and tiny builders.

`HunyuanVideo15Stage` is the shared `FlowMatchingStage` under the name its recipes give their stage."""

from unirl.models.flow.stage import FlowMatchingStage as HunyuanVideo15Stage
from unirl.models.hunyuanvideo.bundle import HunyuanVideo15Bundle, load_checkpoint
from unirl.models.hunyuanvideo.config import (
    LORA_TARGETS,
    HunyuanVideo15I2VModelConfig,
    HunyuanVideo15ModelConfig,
    TinyHunyuanVideo15Config,
)

__all__ = [
    "LORA_TARGETS",
    "HunyuanVideo15Bundle",
    "HunyuanVideo15I2VModelConfig",
    "HunyuanVideo15ModelConfig",
    "HunyuanVideo15Stage",
    "TinyHunyuanVideo15Config",
    "load_checkpoint",
]
