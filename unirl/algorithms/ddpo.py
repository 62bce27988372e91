"""DDPO (Black et al., 2023): PPO over the denoising MDP, its importance-sampling form DDPO-IS.

Each SDE step is an action whose reward is the sample's, so the per-step advantage is
the sample advantage A, clipped to [-adv_clip_max, adv_clip_max]; with
r = exp(logp_new - logp_old) per step:
    L = mean_{i,t} max(-A r, -A clip(r, 1 - eps, 1 + eps))
This is Flow-GRPO's loss (`FlowGRPO` drives it) with DDPO's settings: the tiny clip
eps = 1e-4, the advantage clip and no KL term. DDPO's per-prompt reward statistics
are the group advantage (`advantage.scope: group`); its `timestep_fraction` is the
SDE-step selection on the sampling params.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from unirl.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig, StepChunk
from unirl.types.rollout_resp import RolloutTrack


@dataclass
class DDPOConfig(FlowGRPOConfig):
    """DDPO-IS settings (and `FlowGRPOConfig`'s: `clip_range` is DDPO's `clip_range`, 1e-4).

    Attributes:
        adv_clip_max: advantages are clipped to [-adv_clip_max, adv_clip_max] in the loss
            (DDPO's 5.0).
    """

    adv_clip_max: float = 5.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.adv_clip_max > 0:
            raise ValueError(f"algorithm.config.adv_clip_max must be > 0, got {self.adv_clip_max}")


class DDPO(FlowGRPO):
    """DDPO-IS on a diffusion track (`LatentSegment` with SDE log-probs)."""

    def __init__(self, config: DDPOConfig | None = None) -> None:
        super().__init__(config or DDPOConfig())

    def policy_loss(
        self, chunk: StepChunk, track: RolloutTrack, adv: torch.Tensor, ctx: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        c = self.config.adv_clip_max
        loss, ratio, metrics = super().policy_loss(chunk, track, adv.clamp(-c, c), ctx)
        metrics["ddpo/adv_clipped_frac"] = float((adv.abs() > c).float().mean())
        return loss, ratio, metrics
