"""The typed boundary between rollout and training: pure data, no nn.Module, no Ray."""

from unirl.types.advantages import AdvantageConfig
from unirl.types.reward import RewardRequest, RewardResponse
from unirl.types.rollout_req import PromptExample, RolloutReq
from unirl.types.rollout_resp import RolloutResp, RolloutTrack
from unirl.types.sampling import DiffusionSamplingParams, ImageTokenSamplingParams, TextSamplingParams
from unirl.types.segments import LatentSegment, TokenSegment

__all__ = [
    "AdvantageConfig",
    "DiffusionSamplingParams",
    "ImageTokenSamplingParams",
    "LatentSegment",
    "PromptExample",
    "RewardRequest",
    "RewardResponse",
    "RolloutReq",
    "RolloutResp",
    "RolloutTrack",
    "TextSamplingParams",
    "TokenSegment",
]
