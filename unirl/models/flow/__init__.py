"""The shared flow-matching stage and the contract a diffusion family implements for it."""

from unirl.models.flow.family import NEGATIVE, FlowFamily, FlowModelConfig
from unirl.models.flow.guidance import ClassifierFreeGuidance, EmbeddedGuidance, TrueCFGGuidance, Uncond
from unirl.models.flow.stage import FlowMatchingStage

__all__ = [
    "NEGATIVE",
    "ClassifierFreeGuidance",
    "EmbeddedGuidance",
    "FlowFamily",
    "FlowMatchingStage",
    "FlowModelConfig",
    "TrueCFGGuidance",
    "Uncond",
]
