"""Rewards: backends that score media per component, and the service that weighs and attaches them."""

from unirl.reward.base import LocalRewardBackend, RewardBackend, Scorer
from unirl.reward.local import ColorTarget, JpegCompressibility, JpegIncompressibility
from unirl.reward.service import RewardError, RewardService

__all__ = [
    "ColorTarget",
    "JpegCompressibility",
    "JpegIncompressibility",
    "LocalRewardBackend",
    "RewardBackend",
    "RewardError",
    "RewardService",
    "Scorer",
]
