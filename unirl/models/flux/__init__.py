"""FLUX.1 model family: the bundle (a `FlowFamily`), its model config and tiny builders, and
FLUX.1-Kontext (`kontext.py`: the same model editing a condition image).

`FluxStage` is the shared `FlowMatchingStage` under the name FLUX recipes give their stage."""

from unirl.models.flow.stage import FlowMatchingStage as FluxStage
from unirl.models.flux.bundle import FluxBundle, load_checkpoint
from unirl.models.flux.config import LORA_TARGETS, FluxModelConfig, TinyFluxConfig
from unirl.models.flux.kontext import FluxKontextBundle, FluxKontextModelConfig

__all__ = [
    "LORA_TARGETS",
    "FluxBundle",
    "FluxKontextBundle",
    "FluxKontextModelConfig",
    "FluxModelConfig",
    "FluxStage",
    "TinyFluxConfig",
    "load_checkpoint",
]
