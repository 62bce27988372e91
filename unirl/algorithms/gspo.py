"""GSPO: GRPO's clip applied to a sequence-level ratio.

Per sample i with response mask m: s_i = exp(mean_t (logp_t - logp_old_t)) over its
tokens (the log clamped to +-20), and the loss max(-A_i s_i, -A_i clip(s_i, 1 - eps_low,
1 + eps_high)) with the sequence-level advantage A_i. It is computed per token with

    log r_t = sg(log s_i) + logp_t - sg(logp_t)

so r_t = s_i in value and d r_t = s_i d logp_t; with seq-mean-token-mean aggregation
(the default) the gradient equals that of the sequence-level loss above, whose
d s_i = s_i mean_t d logp_t. The clip range is small (3e-4 / 4e-4) because s_i is a
per-token geometric mean. No dual clip.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from unirl.algorithms.grpo import GRPO, TokenLossConfig
from unirl.algorithms.token_losses import LOG_RATIO_CLAMP, LossAggMode, clipped_token_loss, masked_mean
from unirl.models.stage import TextStage
from unirl.types.advantages import TOKEN_ESTIMATORS, AdvantageConfig
from unirl.types.constraints import OpenUnit, Positive
from unirl.types.rollout_resp import RolloutTrack


@dataclass
class GSPOConfig(TokenLossConfig):
    """The shared settings (default aggregation seq-mean-token-mean) plus the clip.

    Attributes:
        eps_low, eps_high: the sequence ratio is clipped to [1 - eps_low, 1 + eps_high].
    """

    loss_agg_mode: LossAggMode = "seq-mean-token-mean"
    eps_low: OpenUnit = 3e-4
    eps_high: Positive = 4e-4


def sequence_log_ratio(logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] per-token log r_t = sg(log s_i) + logp_t - sg(logp_t), log s_i the masked mean of
    logp - old_logp over sample i's tokens, clamped to +-20."""
    log_s = ((logp - old_logp) * mask).sum(dim=1) / mask.sum(dim=1).clamp(min=1)
    log_s = torch.clamp(log_s, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).detach()
    return log_s[:, None] + logp - logp.detach()


class GSPO(GRPO):
    """GSPO on a text track; needs per-sample advantages ([B]). Metrics as GRPO's, the
    ratios being the sequence ratios s_i repeated over each response's tokens."""

    Config: ClassVar[type] = GSPOConfig

    @staticmethod
    def check_advantage(cfg: AdvantageConfig) -> None:
        """GSPO's advantage is per sequence: refuse the per-token estimators."""
        if cfg.estimator in TOKEN_ESTIMATORS:
            raise ValueError(
                f"algorithm GSPO needs a sequence-level advantage: advantage.estimator={cfg.estimator!r} gives "
                "per-token advantages; use grpo or rloo"
            )

    def policy_loss(
        self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        cfg = self.config
        r = torch.exp(sequence_log_ratio(logp, old_logp, mask))
        loss, clipped, _ = clipped_token_loss(r, adv, cfg.eps_low, cfg.eps_high)
        return loss, r, {"clipfrac": float(masked_mean(clipped.float(), mask))}

    def compute_loss_and_backward(
        self, stage: TextStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        if track.advantages is not None and track.advantages.dim() != 1:
            raise ValueError(
                f"track {track.name!r} has per-token advantages {list(track.advantages.shape)}; GSPO needs one "
                "per sample (advantage.estimator grpo or rloo)"
            )
        return super().compute_loss_and_backward(stage, track, ctx)
