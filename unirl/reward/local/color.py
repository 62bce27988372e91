"""Closeness of an image to a target colour (brightness is the grey case)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from unirl.types.reward import RewardRequest


class ColorTarget:
    """Scorer: 1 - mean over pixels and channels of |pixel / 255 - target|.

    Dense (every pixel contributes) and weight-free (the backend weighs it);
    scores lie in [0, 1], 1 meaning every pixel equals the target. A
    brightness reward is `target=[b, b, b]`; with b = 1 the score is the mean
    pixel intensity.

    Args:
        target: RGB colour, three values in [0, 1].
    """

    def __init__(self, target: Sequence[float] = (1.0, 1.0, 1.0)) -> None:
        values = list(target)
        if len(values) != 3 or not all(
            isinstance(v, (int, float)) and math.isfinite(v) and 0.0 <= v <= 1.0 for v in values
        ):
            raise ValueError(f"ColorTarget target must be 3 RGB values in [0, 1], got {target!r}")
        self.target = torch.tensor(values, dtype=torch.float32)

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images` ([B, 3, H, W] uint8)."""
        return self.score_differentiable(req.require_images("ColorTarget").to(torch.float32) / 255.0, [], [])

    def score_differentiable(
        self, images: torch.Tensor, prompts: Sequence[str], metadata: Sequence[dict[str, Any]]
    ) -> torch.Tensor:
        """[B] 1 - mean |images - target| of float images [B, 3, H, W] in [0, 1], with the graph
        (a `DifferentiableReward`; prompts and metadata are not read)."""
        target = self.target.to(device=images.device, dtype=images.dtype).view(1, 3, 1, 1)
        return 1.0 - (images - target).abs().mean(dim=(1, 2, 3))
