"""DRPO (UniRL): a smooth, advantage-weighted quadratic trust region instead of a clip.

Per response token, with r_t = exp(clamp(logp_t - logp_old_t, -20, 20)):

    L_t = -A r_t + |A| mu_t (r_t - 1)^2 / (2 eps)

mu_t is the probability the rollout policy gave the sampled token, exp(logp_old_t)
(`penalty_mu_weighted: true`, UniRL's default): the penalty then bounds |r_t - 1| by a
token-adaptive eps / mu_t, i.e. |pi - pi_old| <= eps on the probability itself, loose
for rare tokens and tight for likely ones. With `penalty_mu_weighted: false`, mu_t = 1
(a fixed quadratic penalty, plain SPO). r_t is not clipped: the gradient
-A + |A| mu_t (r_t - 1) / eps shrinks as r_t moves in the advantage's direction and
turns corrective past r_t - 1 = sign(A) eps / mu_t. UniRL's default eps is 12.5
(`drpo_epsilon`); pi_old is the rollout's log-probs by default (`old_logp_source`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from unirl.algorithms.grpo import GRPO, TokenLossConfig
from unirl.algorithms.token_losses import masked_mean, ratio
from unirl.types.constraints import Positive


@dataclass
class DRPOConfig(TokenLossConfig):
    """The shared settings plus DRPO's penalty.

    Attributes:
        drpo_epsilon: eps of the quadratic penalty (> 0; larger is weaker).
        penalty_mu_weighted: weight the penalty by the rollout token probability
            mu_t = exp(logp_old_t) (token-adaptive region eps / mu_t); false: mu_t = 1.
    """

    drpo_epsilon: Positive = 12.5
    penalty_mu_weighted: bool = True


def drpo_token_loss(
    r: torch.Tensor, mu: torch.Tensor, adv: torch.Tensor, epsilon: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(L_t, penalty_t), all [B, R]: L_t = -A r_t + penalty_t with penalty_t = |A| mu_t (r_t - 1)^2 / (2 eps);
    `mu` is the (detached) rollout token probability, or ones."""
    penalty = adv.abs() * mu * (r - 1).square() / (2 * epsilon)
    return -adv * r + penalty, penalty


class DRPO(GRPO):
    """DRPO on a text track. Metrics as GRPO's, with `drpo/penalty` (the masked mean of
    the penalty term) and `drpo/outside_region` (share of tokens with |r_t - 1| >
    eps / mu_t) instead of clip fractions."""

    Config: ClassVar[type] = DRPOConfig

    def policy_loss(
        self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        cfg = self.config
        r = ratio(logp, old_logp)
        mu = torch.exp(old_logp).detach() if cfg.penalty_mu_weighted else torch.ones_like(old_logp)
        loss, penalty = drpo_token_loss(r, mu, adv, cfg.drpo_epsilon)
        outside = (r.detach() - 1).abs() * mu > cfg.drpo_epsilon
        return (
            loss,
            r,
            {
                "drpo/penalty": float(masked_mean(penalty.detach(), mask)),
                "drpo/outside_region": float(masked_mean(outside.float(), mask)),
            },
        )
