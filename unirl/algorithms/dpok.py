"""DPOK (Fan et al., 2023): policy gradient KL-regularised to the frozen pretrained model.

Per SDE step t of sample i, with r = exp(logp_new - logp_old), advantage A and the
exact Gaussian KL of the step to the reference (LoRA disabled, or the frozen initial
weights of a full fine-tune), both steps sharing the transition std s_t:
    L = mean_{i,t} -alpha * A * clip(r, 1 - eps, 1 + eps) + beta * mean_{i,t} KL_t
    KL_t = mean_{non-batch}((mu_theta - mu_ref)^2) / (2 s_t^2)
The ratio is clamped, not PPO's max: outside [1 - eps, 1 + eps] the step gives no
policy gradient whichever way it moved (DPOK's code). beta is fixed or adaptive
(`kl_target`, `unirl.algorithms.kl_control`).

Differences from the reference code, on purpose: the advantage is the group one
(`advantage.scope: group`) instead of DPOK's learned value baseline, and the KL is
the step's Gaussian KL (the means' squared distance over 2 s_t^2, as in the paper)
where DPOK's code regularises the squared noise-prediction difference without the
1 / (2 s_t^2).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from unirl.algorithms.flow_grpo import FlowGRPO, StepChunk, StepLossConfig
from unirl.types.constraints import OpenUnit, Positive
from unirl.types.rollout_resp import RolloutTrack


@dataclass
class DPOKConfig(StepLossConfig):
    """DPOK settings (and `StepLossConfig`'s).

    Attributes:
        beta: the KL weight (DPOK's `kl_weight`, 0.01); must be > 0: the KL to the
            frozen reference is what DPOK is (without it, use DDPO).
        reward_weight: alpha, the policy-gradient weight (DPOK's 10 for SD1.5 with
            raw rewards; about 1 with unit-scale group advantages).
        ratio_clip: eps of the ratio clamp (DPOK's 1e-4).
    """

    beta: float = 0.01
    reward_weight: Positive = 1.0
    ratio_clip: OpenUnit = 1e-4

    def __post_init__(self) -> None:
        if not self.beta > 0:  # before the shared checks: this is the error that says why
            raise ValueError(
                f"algorithm.config.beta must be > 0 for DPOK, got {self.beta}: DPOK regularises toward the "
                "frozen reference model (for no KL term use unirl.algorithms.ddpo.DDPO)"
            )
        super().__post_init__()


def dpok_policy_loss(
    new_logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, alpha: float, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise -alpha * A * clamp(r, 1 - eps, 1 + eps) and the ratio r; [B, k], adv [B]."""
    ratio = torch.exp(new_logp - old_logp)
    return -alpha * adv.unsqueeze(1) * torch.clamp(ratio, 1 - eps, 1 + eps), ratio


class DPOK(FlowGRPO):
    """DPOK on a diffusion track (`LatentSegment` with SDE log-probs); keeps the reference."""

    Config: ClassVar[type] = DPOKConfig

    def policy_loss(
        self, chunk: StepChunk, track: RolloutTrack, adv: torch.Tensor, ctx: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        cfg = self.config
        loss, ratio = dpok_policy_loss(chunk.new_logp, chunk.old_logp, adv, cfg.reward_weight, cfg.ratio_clip)
        clipfrac = float(((ratio.detach() - 1).abs() > cfg.ratio_clip).float().mean())
        return loss, ratio, {"clipfrac": clipfrac}

    def kl_scale(self, chunk: StepChunk) -> torch.Tensor:
        """The transition std: the exact Gaussian KL of the step."""
        return chunk.transition_std
