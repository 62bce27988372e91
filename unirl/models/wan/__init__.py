"""Wan video model family: Wan 2.1 / 2.2 text-to-video (one transformer, or Wan 2.2 A14B's two
experts: `experts.py`) and Wan 2.2 image-to-video (`i2v.py`, imported where a recipe names it: it
pulls in `WanImageToVideoPipeline`); the bundles (`FlowFamily`s), their model configs and tiny
builders.

`WanStage` is the shared `FlowMatchingStage` under the name Wan recipes give their stage."""

from unirl.models.flow.stage import FlowMatchingStage as WanStage
from unirl.models.wan.bundle import WanBundle, load_checkpoint
from unirl.models.wan.config import LORA_TARGETS, TinyWanConfig, WanI2VModelConfig, WanModelConfig

__all__ = [
    "LORA_TARGETS",
    "TinyWanConfig",
    "WanBundle",
    "WanI2VModelConfig",
    "WanModelConfig",
    "WanStage",
    "load_checkpoint",
]
