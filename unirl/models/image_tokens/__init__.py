"""The shared image-token stage: a unified model's VQ image tokens drawn after a text context
(`VQImageStage`) over any bundle that satisfies `ImageTokenFamily` (Janus's is one)."""

from unirl.models.image_tokens.family import ImageTokenFamily, image_token_family_problems
from unirl.models.image_tokens.stage import VQImageStage, unwrapped

__all__ = ["ImageTokenFamily", "VQImageStage", "image_token_family_problems", "unwrapped"]
