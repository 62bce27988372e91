"""Janus family (transformers' `JanusForConditionalGeneration`): one backbone that writes text
(the plan, through the shared text stage `unirl.models.causal_lm.CausalLMStage`) and draws VQ
image tokens (`JanusImageStage`, with Janus's classifier-free guidance and VQ-VAE decode)."""

from unirl.models.janus.bundle import JanusBundle, JanusModelConfig, TinyJanusConfig
from unirl.models.janus.stage import JanusImageStage

__all__ = ["JanusBundle", "JanusImageStage", "JanusModelConfig", "TinyJanusConfig"]
