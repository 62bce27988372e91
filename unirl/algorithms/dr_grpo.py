"""Dr.GRPO: GRPO without its length and std biases.

Two changes to GRPO ("Understanding R1-Zero-Like Training"): the advantage is
`r - mean_g` (no division by the group std: the recipe sets
`advantage.norm_by_std: false`, or uses `advantage.estimator: rloo`), and each
response's token losses are summed and divided by a constant, the max response
length, instead of by the response's own length (`loss_agg_mode:
seq-mean-token-sum-norm`, `norm_constant: ${sampling.max_new_tokens}`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from unirl.algorithms.grpo import GRPO, GRPOConfig
from unirl.algorithms.token_losses import LossAggMode
from unirl.types.advantages import AdvantageConfig


@dataclass
class DrGRPOConfig(GRPOConfig):
    """GRPO's settings with `loss_agg_mode: seq-mean-token-sum-norm`; `norm_constant`
    (the max response length, `${sampling.max_new_tokens}`) is required."""

    loss_agg_mode: LossAggMode = "seq-mean-token-sum-norm"


class DrGRPO(GRPO):
    """Dr.GRPO on a text track; the loss, ctx and metrics are GRPO's."""

    Config: ClassVar[type] = DrGRPOConfig

    @staticmethod
    def check_advantage(cfg: AdvantageConfig) -> None:
        """Raise unless the advantages are group-centred without std normalisation
        (estimator grpo with norm_by_std false, or rloo); the recipe validator calls it."""
        if cfg.estimator == "grpo" and cfg.norm_by_std:
            raise ValueError(
                "algorithm DrGRPO needs advantages without std normalisation: set advantage.norm_by_std: false "
                "(got true)"
            )
        if cfg.estimator not in ("grpo", "rloo"):
            raise ValueError(
                f"algorithm DrGRPO needs group-centred advantages (advantage.estimator grpo with "
                f"norm_by_std: false, or rloo); advantage.estimator={cfg.estimator!r} whitens by the batch std"
            )
