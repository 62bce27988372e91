"""Rewards: backends that score images or texts per component, and the service that weighs and attaches them."""

from unirl.reward.base import LocalRewardBackend, RewardBackend, Scorer
from unirl.reward.local import (
    ColorTarget,
    ExactAnswer,
    FormatCheck,
    JpegCompressibility,
    JpegIncompressibility,
    OverlongPenalty,
    TargetCharFraction,
)
from unirl.reward.remote import RemoteRewardBackend, RemoteRewardError
from unirl.reward.service import RewardError, RewardService

__all__ = [
    "ColorTarget",
    "ExactAnswer",
    "FormatCheck",
    "JpegCompressibility",
    "JpegIncompressibility",
    "LocalRewardBackend",
    "OverlongPenalty",
    "RemoteRewardBackend",
    "RemoteRewardError",
    "RewardBackend",
    "RewardError",
    "RewardService",
    "Scorer",
    "TargetCharFraction",
]
