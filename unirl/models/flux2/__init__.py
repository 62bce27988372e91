"""FLUX.2 model family: FLUX.2-dev and FLUX.2-Klein bundles (`FlowFamily`s), their model configs
(with reference images: `Flux2EditModelConfig`, `Flux2KleinEditModelConfig`) and tiny builders.

`Flux2Stage` is the shared `FlowMatchingStage` under the name FLUX.2 recipes give their stage."""

from unirl.models.flow.stage import FlowMatchingStage as Flux2Stage
from unirl.models.flux2.bundle import Flux2Bundle, Flux2KleinBundle, load_checkpoint
from unirl.models.flux2.config import (
    LORA_TARGETS,
    Flux2EditModelConfig,
    Flux2KleinEditModelConfig,
    Flux2KleinModelConfig,
    Flux2ModelConfig,
    TinyFlux2Config,
    TinyFlux2KleinConfig,
)

__all__ = [
    "LORA_TARGETS",
    "Flux2Bundle",
    "Flux2EditModelConfig",
    "Flux2KleinEditModelConfig",
    "Flux2KleinBundle",
    "Flux2KleinModelConfig",
    "Flux2ModelConfig",
    "Flux2Stage",
    "TinyFlux2Config",
    "TinyFlux2KleinConfig",
    "load_checkpoint",
]
