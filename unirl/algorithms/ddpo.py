"""DDPO (Black et al., 2023): PPO over the denoising MDP, its importance-sampling form DDPO-IS.

Each SDE step is an action whose reward is the sample's, so the per-step advantage is
the sample advantage A, clipped to [-adv_clip_max, adv_clip_max]; with
r = exp(logp_new - logp_old) per step:
    L = mean_{i,t} max(-A r, -A clip(r, 1 - eps, 1 + eps))
This is Flow-GRPO's loss (`FlowGRPO` drives it, the advantage clip included) with DDPO's
settings: the tiny clip eps = 1e-4, the advantage clip at 5 and no KL term. DDPO's
per-prompt reward statistics are the group advantage (`advantage.scope: group`); its
`timestep_fraction` is the SDE-step selection on the sampling params.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from unirl.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig


@dataclass
class DDPOConfig(FlowGRPOConfig):
    """DDPO-IS settings: `FlowGRPOConfig`'s, whose defaults are DDPO's (`clip_range` 1e-4,
    `adv_clip_max` 5.0, `beta` 0)."""


class DDPO(FlowGRPO):
    """DDPO-IS on a diffusion track (`LatentSegment` with SDE log-probs)."""

    adv_clipped_key: ClassVar[str] = "ddpo/adv_clipped_frac"

    Config: ClassVar[type] = DDPOConfig
