"""`RolloutResp` and `RolloutTrack`: what a rollout produced, per stage.

Reward -> advantage shaping lives here (`RolloutTrack.compute_advantages`), so
every algorithm and every trainer share one implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from unirl.types.batch import concat, select, split
from unirl.types.segments import LatentSegment, TokenSegment

ADVANTAGE_SCOPES = ("group", "global")


@dataclass
class AdvantageConfig:
    """How rewards become advantages.

    Attributes:
        scope: "group" z-scores within each group of siblings; "global" over
            the whole batch.
        global_std: with scope "group", divide by the batch std instead of
            the group std (flow_grpo's `global_std`).
        eps: added to the std.
        clip: clip advantages to [-clip, clip]; None disables.
    """

    scope: str = "group"
    global_std: bool = False
    eps: float = 1e-4
    clip: float | None = None

    def __post_init__(self) -> None:
        if self.scope not in ADVANTAGE_SCOPES:
            raise ValueError(f"advantage.scope must be one of {ADVANTAGE_SCOPES}, got {self.scope!r}")
        if self.clip is not None and self.clip <= 0:
            raise ValueError(f"advantage.clip must be > 0 or null, got {self.clip}")
        if not self.eps > 0:
            raise ValueError(f"advantage.eps must be > 0, got {self.eps}")


def group_layout(group_ids: list[str]) -> tuple[int, int]:
    """(num_groups, group_size) of contiguous, uniform groups; raise otherwise."""
    if not group_ids:
        raise ValueError("cannot compute advantages of an empty batch")
    runs: list[tuple[str, int]] = []
    for gid in group_ids:
        if runs and runs[-1][0] == gid:
            runs[-1] = (gid, runs[-1][1] + 1)
        else:
            runs.append((gid, 1))
    seen = [g for g, _ in runs]
    if len(set(seen)) != len(seen):
        dup = next(g for g in seen if seen.count(g) > 1)
        raise ValueError(
            f"group {dup!r} is not contiguous: siblings of a prompt must be adjacent in the batch "
            "(build requests with RolloutReq.from_prompts and keep sample order)"
        )
    sizes = {n for _, n in runs}
    if len(sizes) != 1:
        raise ValueError(
            f"groups must all have the same size, got sizes {sorted(sizes)} for {len(runs)} groups"
        )
    return len(runs), sizes.pop()


def compute_advantages(rewards: torch.Tensor, group_ids: list[str], cfg: AdvantageConfig) -> torch.Tensor:
    """[B] fp32 advantages from [B] rewards.

    group scope: A = (r - mean_g) / (std_g + eps), std_g the population std of
    the group (or of the batch with `global_std`). global scope: A = (r -
    mean) / (std + eps) over the batch. Then optional clipping.

    Computed in float64 on rewards shifted by their group's first value (the
    batch's first value for global scope): the mean and std are unchanged, and a
    group whose rewards are all equal centres to exactly 0 whatever the value
    (0.7, a weighted sum of components), so it gets exactly zero advantage
    instead of a rounding residue divided by `eps`.
    """
    if rewards.dim() != 1 or rewards.numel() != len(group_ids):
        raise ValueError(
            f"rewards must be [B] with B = len(group_ids) = {len(group_ids)}, got {list(rewards.shape)}"
        )
    r = rewards.detach().to(torch.float64)
    if cfg.scope == "global":
        d = r - r[0]
        adv = (d - d.mean()) / (d.std(unbiased=False) + cfg.eps)
    else:
        num_groups, size = group_layout(group_ids)
        g = r.view(num_groups, size)
        d = g - g[:, :1]
        centered = d - d.mean(dim=1, keepdim=True)
        std = (r - r[0]).std(unbiased=False) if cfg.global_std else d.std(dim=1, unbiased=False, keepdim=True)
        adv = (centered / (std + cfg.eps)).reshape(-1)
    if cfg.clip is not None:
        adv = adv.clamp(-cfg.clip, cfg.clip)
    return adv.to(torch.float32)


@dataclass
class RolloutTrack:
    """One generation stage's output for a batch of samples.

    Attributes:
        name: track name ("diffusion", "ar", ...).
        sample_ids, group_ids, prompts, metadata: per sample, in request order.
        segment: the trajectory (`LatentSegment` or `TokenSegment`).
        conditions: per-sample condition tensors replay needs (e.g. prompt
            embeddings), each [B, ...].
        media: [B, 3, H, W] uint8 images (or None for text stages).
        texts: per-sample decoded response text of a text stage (None for images).
        rewards: [B] fp32 once scored.
        reward_components: name -> [B] fp32 unweighted component scores.
        advantages: [B] fp32 once computed.
        parent_ids: per-sample ids of the samples this one was derived from
            (composed rollouts); None for a root stage.
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
    rollout_id: int = 0

    PER_SAMPLE = (
        "sample_ids",
        "group_ids",
        "prompts",
        "metadata",
        "segment",
        "conditions",
        "media",
        "texts",
        "rewards",
        "reward_components",
        "advantages",
        "parent_ids",
    )

    def __len__(self) -> int:
        return len(self.sample_ids)

    def select(self, idx: list[int]) -> RolloutTrack:
        return select(self, idx)

    def split(self, parts: int) -> list[RolloutTrack]:
        """`parts` contiguous equal shards by sample (data-parallel scatter)."""
        return split(self, parts)

    @staticmethod
    def concat(parts: list[RolloutTrack]) -> RolloutTrack:
        """Reassemble shards in order (data-parallel gather)."""
        return concat(parts)

    def compute_advantages(self, cfg: AdvantageConfig) -> torch.Tensor:
        """Set and return `advantages` from `rewards` (see `compute_advantages`)."""
        if self.rewards is None:
            raise ValueError(f"track {self.name!r} has no rewards: score it before computing advantages")
        self.advantages = compute_advantages(self.rewards, self.group_ids, cfg)
        return self.advantages


@dataclass
class RolloutResp:
    """The result of one rollout: one track per generation stage."""

    tracks: dict[str, RolloutTrack]
    metrics: dict[str, float] = field(default_factory=dict)

    def track(self, name: str) -> RolloutTrack:
        if name not in self.tracks:
            raise KeyError(f"rollout has no track {name!r}; tracks: {sorted(self.tracks)}")
        return self.tracks[name]
