"""Z-Image model family: the bundle (a `FlowFamily`), its model config and tiny builders.

`ZImageStage` is the shared `FlowMatchingStage` under the name Z-Image recipes give their stage."""

from unirl.models.flow.stage import FlowMatchingStage as ZImageStage
from unirl.models.zimage.bundle import ZImageBundle, load_checkpoint
from unirl.models.zimage.config import LORA_TARGETS, TinyZImageConfig, ZImageModelConfig

__all__ = [
    "LORA_TARGETS",
    "TinyZImageConfig",
    "ZImageBundle",
    "ZImageModelConfig",
    "ZImageStage",
    "load_checkpoint",
]
