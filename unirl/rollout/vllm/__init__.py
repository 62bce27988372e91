"""vLLM as a rollout engine (see README.md here); `vllm` itself is imported only when an engine is built."""

from unirl.rollout.vllm.engine import VLLMEngine, merged_weights

__all__ = ["VLLMEngine", "merged_weights"]
