"""`RolloutResp` and `RolloutTrack`: what a rollout produced, per stage.

Reward -> advantage shaping is `unirl.algorithms.advantages.track_advantages`, one
implementation every algorithm and every trainer share.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from unirl.types.batch import SampleBatch
from unirl.types.rollout_req import RolloutReq
from unirl.types.segments import LatentSegment, TokenSegment

__all__ = ["RolloutResp", "RolloutTrack"]


@dataclass
class RolloutTrack(SampleBatch):
    """One generation stage's output for a batch of samples.

    Attributes:
        name: track name ("diffusion", "ar", ...).
        sample_ids, group_ids, prompts, metadata: per sample, in request order.
        segment: the trajectory (`LatentSegment` or `TokenSegment`).
        conditions: per-sample condition tensors replay needs (e.g. prompt
            embeddings), each [B, ...].
        media: [B, 3, H, W] uint8 images, [B, F, 3, H, W] uint8 videos (a video family), or
            None for text stages.
        audio: [B, A, T] fp32 waveforms beside the videos of an audio-video family (LTX-2), else
            None; `audio_rate` their sample rate in Hz (0 without audio).
        texts: per-sample decoded response text of a text stage (None for images).
        rewards: [B] fp32 once scored.
        reward_components: name -> [B] fp32 unweighted component scores.
        reward_weights: name -> the weight of each component in `rewards` (shared by the batch).
        advantages: fp32 once computed: [B] per sample, or [B, Rmax] per response
            token (right-padded with 0) from a token-level estimator.
        parent_ids: per sample, the id of the parent track's sample this one was derived
            from (a composed rollout's image names the rewrite it rendered); None for a
            root track.
        root_ids: per sample, the group id of the root prompt the sample descends from
            (the user prompt of a composed rollout); None for a root track, whose own
            `group_ids` are the roots.
        rollout_id: the rollout that produced the track.
    """

    name: str
    sample_ids: list[str]
    group_ids: list[str]
    prompts: list[str]
    metadata: list[dict[str, Any]]
    segment: LatentSegment | TokenSegment
    conditions: dict[str, torch.Tensor] = field(default_factory=dict)
    media: torch.Tensor | None = None
    texts: list[str] | None = None
    rewards: torch.Tensor | None = None
    reward_components: dict[str, torch.Tensor] = field(default_factory=dict)
    advantages: torch.Tensor | None = None
    parent_ids: list[str] | None = None
    root_ids: list[str] | None = None
    rollout_id: int = 0
    reward_weights: dict[str, float] = field(default_factory=dict)
    audio: torch.Tensor | None = None
    audio_rate: int = 0

    PER_SAMPLE = (
        "sample_ids",
        "group_ids",
        "prompts",
        "metadata",
        "segment",
        "conditions",
        "media",
        "audio",
        "texts",
        "rewards",
        "reward_components",
        "advantages",
        "parent_ids",
        "root_ids",
    )

    @classmethod
    def of_request(
        cls, name: str, req: RolloutReq, segment: LatentSegment | TokenSegment, **extra: Any
    ) -> RolloutTrack:
        """The track `name` of request `req`: its sample and group ids, prompts,
        metadata, rollout id and lineage, with `segment` and `extra` fields (texts, media, conditions)."""
        return cls(
            name=name,
            sample_ids=req.sample_ids,
            group_ids=req.group_ids,
            prompts=req.prompts,
            metadata=req.metadata,
            segment=segment,
            rollout_id=req.rollout_id,
            parent_ids=req.parent_ids,
            root_ids=req.root_ids,
            **extra,
        )

    def __len__(self) -> int:
        return len(self.sample_ids)


@dataclass
class RolloutResp:
    """The result of one rollout: one track per generation stage."""

    tracks: dict[str, RolloutTrack]
    metrics: dict[str, float] = field(default_factory=dict)

    def track(self, name: str) -> RolloutTrack:
        if name not in self.tracks:
            raise KeyError(f"rollout has no track {name!r}; tracks: {sorted(self.tracks)}")
        return self.tracks[name]
