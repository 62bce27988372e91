"""In-process scorers: `scorer(req: RewardRequest) -> [B]` fp32 tensor (weight-free, over images, videos,
soundtracks or texts; OCR on the PP-OCRv4
weights its package ships; PickScore, CLIPScore, HPSv2, HPSv3, ImageReward and the aesthetic predictor from local checkpoints)."""

from unirl.reward.local.aesthetic import AestheticScore
from unirl.reward.local.audio import Loudness, ToneScore
from unirl.reward.local.color import ColorTarget
from unirl.reward.local.control import RandomDirectionReward, RandomReward
from unirl.reward.local.edit import SourcePreservation
from unirl.reward.local.hps import HPSv2
from unirl.reward.local.hpsv3 import HPSv3
from unirl.reward.local.imagereward import ImageReward
from unirl.reward.local.jpeg import JpegCompressibility, JpegIncompressibility, jpeg_size_kb
from unirl.reward.local.ocr import OCRReward
from unirl.reward.local.pickscore import CLIPScore, PickScore, PickScoreRank
from unirl.reward.local.preference import PreferredDemonstration
from unirl.reward.local.text import ExactAnswer, FormatCheck, OverlongPenalty, TargetCharFraction
from unirl.reward.local.video import ColorMotion, FrameMean

__all__ = [
    "AestheticScore",
    "CLIPScore",
    "ColorMotion",
    "ColorTarget",
    "ExactAnswer",
    "FormatCheck",
    "FrameMean",
    "HPSv2",
    "HPSv3",
    "ImageReward",
    "JpegCompressibility",
    "JpegIncompressibility",
    "Loudness",
    "OCRReward",
    "PickScore",
    "PickScoreRank",
    "PreferredDemonstration",
    "OverlongPenalty",
    "RandomDirectionReward",
    "RandomReward",
    "SourcePreservation",
    "TargetCharFraction",
    "ToneScore",
    "jpeg_size_kb",
]
