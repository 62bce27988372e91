"""`RolloutResp` and `RolloutTrack`: what a rollout produced, per stage.

Reward -> advantage shaping is `RolloutTrack.compute_advantages` (the estimators
live in `advantages.py`), so every algorithm and every trainer share one
implementation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from unirl.types.advantages import (
    AdvantageConfig,
    compute_advantages,
    group_layout,
    kl_penalty,
    value_targets,
)
from unirl.types.batch import concat, select, split
from unirl.types.segments import LatentSegment, TokenSegment

__all__ = ["AdvantageConfig", "RolloutResp", "RolloutTrack", "compute_advantages", "group_layout"]


@dataclass
class RolloutTrack:
    """One generation stage's output for a batch of samples.

    Attributes:
        name: track name ("diffusion", "ar", ...).
        sample_ids, group_ids, prompts, metadata: per sample, in request order.
        segment: the trajectory (`LatentSegment` or `TokenSegment`).
        conditions: per-sample condition tensors replay needs (e.g. prompt
            embeddings), each [B, ...].
        media: [B, 3, H, W] uint8 images, [B, F, 3, H, W] uint8 videos (a video family), or
            None for text stages.
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
        "root_ids",
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
        """Set and return `advantages` from `rewards` (see `compute_advantages`). When `cfg`
        needs tokens (reinforce_pp*, or KL folded into the reward) the response mask and the
        per-token KL (rollout `log_probs` vs `ref_log_probs`) come from the `TokenSegment`."""
        if self.rewards is None:
            raise ValueError(f"track {self.name!r} has no rewards: score it before computing advantages")
        parts = {}
        if cfg.multi_reward == "gdpo":  # each component normalised on its own
            parts = {"components": self.reward_components, "weights": self.reward_weights}
        self.advantages = compute_advantages(self.rewards, self.group_ids, cfg, **self.token_inputs(cfg), **parts)
        return self.advantages

    def value_targets(self, cfg: AdvantageConfig) -> torch.Tensor:
        """[B, Rmax] GAE returns of this track (`value_targets`): the critic's regression targets,
        from `rewards` and the segment's `values` under `cfg` (estimator gae)."""
        if self.rewards is None:
            raise ValueError(f"track {self.name!r} has no rewards: score it before computing returns")
        return value_targets(self.rewards, cfg, **self.token_inputs(cfg))

    def token_inputs(self, cfg: AdvantageConfig) -> dict[str, torch.Tensor]:
        """`mask` ([B, Rmax]), with `cfg.kl_coef > 0` `token_kl` ([B, Rmax], `cfg.kl_estimator`
        of the rollout log-probs against the reference's) and with estimator gae `values` (the
        critic's, [B, Rmax]) for `compute_advantages`; {} when `cfg` needs none of them. A
        diffusion track with estimator gae gives `step_inputs()`: its SDE steps are the tokens."""
        if not cfg.needs_tokens:
            return {}
        seg = self.segment
        if isinstance(seg, LatentSegment) and cfg.estimator == "gae" and cfg.kl_coef == 0:
            return self.step_inputs()
        if not isinstance(seg, TokenSegment):
            raise ValueError(
                f"advantage.estimator={cfg.estimator!r} with advantage.kl_coef={cfg.kl_coef} needs "
                f"per-token data, but track {self.name!r} holds a {type(seg).__name__}; use estimator "
                "grpo or rloo with kl_coef 0 on it"
            )
        out = {"mask": seg.response_mask()}
        if cfg.kl_coef > 0:
            if seg.ref_log_probs is None:
                raise ValueError(
                    f"advantage.kl_coef={cfg.kl_coef} folds the KL into the reward, but track {self.name!r} "
                    "has no ref_log_probs: the rollout must record the reference policy's log-probs"
                )
            logp, ref = seg.padded("log_probs").float(), seg.padded("ref_log_probs").float()
            out["token_kl"] = kl_penalty(logp, ref, cfg.kl_estimator) * out["mask"]
        if cfg.estimator == "gae":
            if seg.values is None:
                raise ValueError(
                    f"advantage.estimator=gae needs per-token values, but track {self.name!r} has none: "
                    "the recipe's critic records them at rollout (set critic)"
                )
            out["values"] = seg.padded("values").float()
        return out

    def step_inputs(self) -> dict[str, torch.Tensor]:
        """GAE's inputs over a diffusion track's K SDE steps: `mask` [B, K] of ones (every sample
        takes every step) and `values` [B, K] (the critic's, `LatentSegment.values`). The reward
        then sits on the last step, as a text response's on its last token."""
        values = getattr(self.segment, "values", None)
        if values is None:
            raise ValueError(
                f"advantage.estimator=gae needs per-step values, but track {self.name!r} has none: "
                "the recipe's critic records them at rollout (set critic)"
            )
        values = values.float()
        return {"mask": torch.ones_like(values), "values": values}


@dataclass
class RolloutResp:
    """The result of one rollout: one track per generation stage."""

    tracks: dict[str, RolloutTrack]
    metrics: dict[str, float] = field(default_factory=dict)

    def track(self, name: str) -> RolloutTrack:
        if name not in self.tracks:
            raise KeyError(f"rollout has no track {name!r}; tracks: {sorted(self.tracks)}")
        return self.tracks[name]
