"""LTX-2 audio-video model family: the bundle (a `FlowFamily` whose latent holds a clip's video and
audio tokens together), its model config and tiny builders.

`LTX2Stage` is the shared `FlowMatchingStage` under the name its recipes give their stage."""

from unirl.models.flow.stage import FlowMatchingStage as LTX2Stage
from unirl.models.ltx2.bundle import LTX2Bundle, load_checkpoint
from unirl.models.ltx2.config import LORA_TARGETS, LTX2ModelConfig, TinyLTX2Config

__all__ = ["LORA_TARGETS", "LTX2Bundle", "LTX2ModelConfig", "LTX2Stage", "TinyLTX2Config", "load_checkpoint"]
