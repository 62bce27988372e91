"""The shared flow-matching stage and the contract a diffusion family implements for it."""

from unirl.models.flow.family import GUIDANCE_STYLES, NEGATIVE, FlowFamily, FlowModelConfig
from unirl.models.flow.stage import FlowMatchingStage

__all__ = ["GUIDANCE_STYLES", "NEGATIVE", "FlowFamily", "FlowMatchingStage", "FlowModelConfig"]
