"""In-process, weight-free scorers: `scorer(req: RewardRequest) -> [B]` fp32 tensor."""

from unirl.reward.local.color import ColorTarget
from unirl.reward.local.jpeg import JpegCompressibility, JpegIncompressibility, jpeg_size_kb

__all__ = ["ColorTarget", "JpegCompressibility", "JpegIncompressibility", "jpeg_size_kb"]
