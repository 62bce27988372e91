"""SD3 / SD3.5 model family: bundle (modules), stage (diffuse / replay / decode), tiny builders."""

from unirl.models.sd3.bundle import SD3Bundle, SD3ModelConfig, TinySD3Config, load_checkpoint
from unirl.models.sd3.stage import SD3Stage

__all__ = ["SD3Bundle", "SD3ModelConfig", "SD3Stage", "TinySD3Config", "load_checkpoint"]
