"""JPEG (in)compressibility rewards, as in DDPO (Black et al., 2023)."""

from __future__ import annotations

import io

import torch
from PIL import Image

from unirl.types.reward import RewardRequest


def jpeg_size_kb(images: torch.Tensor, quality: int) -> torch.Tensor:
    """[B] fp32 JPEG-encoded size of each image in kB (bytes / 1000).

    Args:
        images: [B, 3, H, W] uint8 RGB.
        quality: PIL JPEG quality, 1..100.
    """
    sizes = []
    for image in images.cpu():
        buffer = io.BytesIO()
        Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="JPEG", quality=quality)
        sizes.append(buffer.tell() / 1000)
    return torch.tensor(sizes, dtype=torch.float32)


def _check_quality(quality: int) -> int:
    if not isinstance(quality, int) or not 1 <= quality <= 100:
        raise ValueError(f"jpeg quality must be an int in [1, 100], got {quality!r}")
    return quality


class JpegCompressibility:
    """Scorer: -(JPEG size in kB) per image; smaller files score higher. Dense, weight-free."""

    def __init__(self, quality: int = 95) -> None:
        self.quality = _check_quality(quality)

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images`."""
        return -jpeg_size_kb(req.require_images("JpegCompressibility"), self.quality)


class JpegIncompressibility:
    """Scorer: +(JPEG size in kB) per image; larger files score higher. Dense, weight-free."""

    def __init__(self, quality: int = 95) -> None:
        self.quality = _check_quality(quality)

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        """[B] fp32 scores of `req.images`."""
        return jpeg_size_kb(req.require_images("JpegIncompressibility"), self.quality)
