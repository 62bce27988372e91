"""`AdvantageConfig`: how rewards become advantages (the estimators, in
`unirl.algorithms.advantages`, compute them), and the names of the estimators it accepts."""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Annotated, Literal

from annotated_types import Interval

from unirl.types.constraints import NonNegative, Positive, check_fields

ADVANTAGE_SCOPES = ("group", "global")
ADVANTAGE_ESTIMATORS = ("grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
TOKEN_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")
KLEstimator = Literal["k1", "k2", "k3", "low_var_kl"]
KL_ESTIMATORS = typing.get_args(KLEstimator)
MULTI_REWARD = ("sum", "gdpo")


@dataclass
class AdvantageConfig:
    """How rewards become advantages.

    Attributes:
        estimator: "grpo" (group z-score, the default), "rloo" (leave-one-out
            baseline), "reinforce_pp" (discounted token returns, batch-whitened),
            "reinforce_pp_baseline" (group-centred score broadcast to tokens,
            scaled by the batch std) or "gae" (PPO: generalized advantage
            estimation on a critic's per-token values, batch-whitened). The last
            three give per-token advantages [B, Rmax] and need a text track.
        scope: estimator grpo: "group" normalises within each group of siblings;
            "global" over the whole batch.
        global_std: estimator grpo, scope group: divide by the batch std instead
            of the group std (flow_grpo's `global_std`).
        norm_by_std: estimator grpo: divide by the std; False gives Dr.GRPO's
            `r - mean_g`. The other estimators never divide by a group std.
        eps: added to every std this divides by.
        clip: clip advantages to [-clip, clip]; None disables.
        gamma: estimators reinforce_pp and gae: discount of the token returns, in (0, 1].
        lam: estimator gae: lambda of GAE, in [0, 1] (1: Monte-Carlo returns minus the
            values; 0: one-step TD errors).
        kl_coef: KL to the reference policy folded into the reward (0 disables):
            per sample `r - kl_coef * sum_t kl_t` (grpo, rloo,
            reinforce_pp_baseline), per token `-kl_coef * kl_t` (reinforce_pp).
            Needs the rollout's reference log-probs (`TokenSegment.ref_log_probs`).
        kl_estimator: "k1", "k2", "k3" or "low_var_kl" (= k3), see `kl_penalty`.
        multi_reward: how several reward components make one advantage. "sum" (the default):
            the estimator runs on the weighted sum of the components (the track's reward).
            "gdpo" (GDPO, Liu et al. 2026): each component is normalised within its group
            on its own, the normalised components are summed with the reward's weights, and
            the sum is normalised over the batch: distinct combinations of components keep
            distinct advantages instead of collapsing to one. Needs estimator grpo, scope group,
            norm_by_std, no global_std and kl_coef 0.
    """

    estimator: str = "grpo"
    scope: str = "group"
    global_std: bool = False
    norm_by_std: bool = True
    eps: Positive = 1e-4
    clip: Positive | None = None
    gamma: Annotated[float, Interval(gt=0, le=1)] = 1.0
    lam: float = 1.0
    kl_coef: NonNegative = 0.0
    kl_estimator: str = "low_var_kl"
    multi_reward: str = "sum"

    def __post_init__(self) -> None:
        check_fields(self, "advantage.")
        if self.multi_reward not in MULTI_REWARD:
            raise ValueError(f"advantage.multi_reward must be one of {MULTI_REWARD}, got {self.multi_reward!r}")
        if self.multi_reward == "gdpo" and (
            self.estimator != "grpo" or self.scope != "group" or not self.norm_by_std or self.global_std
            or self.kl_coef > 0
        ):  # fmt: skip
            raise ValueError(
                "advantage.multi_reward=gdpo normalises each component within its group: it needs "
                f"estimator grpo, scope group, norm_by_std true, global_std false and kl_coef 0; got "
                f"estimator={self.estimator}, scope={self.scope}, norm_by_std={self.norm_by_std}, "
                f"global_std={self.global_std}, kl_coef={self.kl_coef}"
            )
        if self.estimator not in ADVANTAGE_ESTIMATORS:
            raise ValueError(
                f"advantage.estimator must be one of {ADVANTAGE_ESTIMATORS}, got {self.estimator!r}"
            )
        if self.scope not in ADVANTAGE_SCOPES:
            raise ValueError(f"advantage.scope must be one of {ADVANTAGE_SCOPES}, got {self.scope!r}")
        if self.kl_estimator not in KL_ESTIMATORS:
            raise ValueError(
                f"advantage.kl_estimator must be one of {KL_ESTIMATORS}, got {self.kl_estimator!r}"
            )
        if self.estimator != "grpo" and (self.scope != "group" or self.global_std):
            raise ValueError(
                f"advantage.scope and advantage.global_std apply to estimator grpo; estimator "
                f"{self.estimator!r} needs scope: group and global_std: false"
            )
        if self.global_std and not self.norm_by_std:
            raise ValueError(
                "advantage.global_std divides by the batch std but advantage.norm_by_std is false"
            )
        if not 0 <= self.lam <= 1:
            raise ValueError(f"advantage.lam must be in [0, 1], got {self.lam}")
        if self.gamma != 1 and self.estimator not in ("reinforce_pp", "gae"):
            raise ValueError(
                f"advantage.gamma discounts reinforce_pp's token returns (and gae's); estimator "
                f"{self.estimator!r} needs gamma: 1.0, got {self.gamma}"
            )
        if self.lam != 1 and self.estimator != "gae":
            raise ValueError(
                f"advantage.lam is GAE's lambda; estimator {self.estimator!r} needs lam: 1.0, got {self.lam}"
            )

    @property
    def needs_tokens(self) -> bool:
        """Whether the estimate needs the response mask (token estimators, KL in the reward)."""
        return self.estimator in TOKEN_ESTIMATORS or self.kl_coef > 0
