"""Reward request and response: the contract between tracks and scorers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class RewardRequest:
    """Media to score.

    Attributes:
        sample_ids: per sample, used to name failures.
        prompts: per sample.
        images: [B, 3, H, W] uint8 RGB.
        metadata: per-sample dicts from the data source.
    """

    sample_ids: list[str]
    prompts: list[str]
    images: torch.Tensor
    metadata: list[dict[str, Any]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4 or self.images.shape[1] != 3:
            raise ValueError(
                f"RewardRequest.images must be uint8 [B, 3, H, W], got {self.images.dtype} "
                f"{list(self.images.shape)}"
            )
        if len(self.sample_ids) != self.images.shape[0] or len(self.prompts) != self.images.shape[0]:
            raise ValueError("RewardRequest sample_ids, prompts and images must have the same length")


@dataclass
class RewardResponse:
    """Scores per component, each [B] fp32 (NaN marks a failed sample)."""

    components: dict[str, torch.Tensor]
