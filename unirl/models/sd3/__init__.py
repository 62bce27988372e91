"""SD3 / SD3.5 model family: the bundle (a `FlowFamily`), its model config and tiny builders.

`SD3Stage` is the shared `FlowMatchingStage` under the name SD3 recipes give their stage."""

from unirl.models.flow.stage import FlowMatchingStage as SD3Stage
from unirl.models.sd3.bundle import SD3Bundle, load_checkpoint
from unirl.models.sd3.config import SD3ModelConfig, TinySD3Config

__all__ = ["SD3Bundle", "SD3ModelConfig", "SD3Stage", "TinySD3Config", "load_checkpoint"]
