"""Janus family (transformers' `JanusForConditionalGeneration`): one backbone that writes text
(the plan, through the shared text stage `unirl.models.causal_lm.CausalLMStage`) and draws VQ
image tokens (through the shared image-token stage `unirl.models.image_tokens.VQImageStage`,
with Janus's classifier-free guidance and VQ-VAE decode). `JanusBundle` is both a
`TextFamily` and an `ImageTokenFamily`."""

from unirl.models.janus.bundle import JanusBundle
from unirl.models.janus.config import JanusModelConfig, TinyJanusConfig

__all__ = ["JanusBundle", "JanusModelConfig", "TinyJanusConfig"]
