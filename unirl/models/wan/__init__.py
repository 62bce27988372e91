"""Wan 2.1 text-to-video model family: the bundle (a `FlowFamily`), its model config and tiny
builders.

`WanStage` is the shared `FlowMatchingStage` under the name Wan recipes give their stage."""

from unirl.models.flow.stage import FlowMatchingStage as WanStage
from unirl.models.wan.bundle import WanBundle, load_checkpoint
from unirl.models.wan.config import LORA_TARGETS, TinyWanConfig, WanModelConfig

__all__ = ["LORA_TARGETS", "TinyWanConfig", "WanBundle", "WanModelConfig", "WanStage", "load_checkpoint"]
