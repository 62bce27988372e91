"""FLUX.1 model family: the bundle (a `FlowFamily`), its model config and tiny builders.

`FluxStage` is the shared `FlowMatchingStage` under the name FLUX recipes give their stage."""

from unirl.models.flow.stage import FlowMatchingStage as FluxStage
from unirl.models.flux.bundle import FluxBundle, load_checkpoint
from unirl.models.flux.config import LORA_TARGETS, FluxModelConfig, TinyFluxConfig

__all__ = ["LORA_TARGETS", "FluxBundle", "FluxModelConfig", "FluxStage", "TinyFluxConfig", "load_checkpoint"]
