"""`OCRAccuracy`: the evaluation summary of the OCR world, read by `unirl.reward.local.OCRReward`."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from unirl.reward.local import OCRReward
from unirl.types.reward import RewardRequest


class OCRAccuracy:
    """`evaluate(images, prompts) -> {"ocr": mean OCR reward, "accuracy": fraction read exactly}`,
    the target of each image the quoted word of its prompt; a read is exact when its reward is 1
    (`ocr_score`: edit distance 0 after spaces and case are dropped). Args: those of `OCRReward`."""

    def __init__(self, **ocr: object) -> None:
        self.ocr = OCRReward(**ocr)

    def scores(self, images: torch.Tensor, prompts: Sequence[str]) -> torch.Tensor:
        """[B] OCR rewards of `images` ([B, 3, H, W] uint8) against their prompts."""
        req = RewardRequest(
            sample_ids=[str(i) for i in range(len(prompts))], prompts=list(prompts), images=images
        )
        return self.ocr(req).float()

    def evaluate(self, images: torch.Tensor, prompts: Sequence[str]) -> dict[str, float]:
        scores = self.scores(images, prompts)
        return {"ocr": float(scores.mean()), "accuracy": float((scores == 1.0).float().mean())}
