"""PPO for text: the clipped token loss on GAE advantages, and the critic's clipped value loss.

The policy loss is GRPO's (`grpo.GRPO.policy_loss`: per token `max(-A r_t, -A clip(r_t,
1 - eps_low, 1 + eps_high))`, dual clip for A < 0) on per-token advantages from
`advantage.estimator: gae` (`unirl.types.advantages.gae`, whitened over the batch's response
tokens), so `PPO` differs from `GRPO` only in what it asks of the recipe: a critic and GAE.

The critic's loss (`ValueLoss`, verl's): with V the critic's current values, V_old the values
recorded at rollout (`TokenSegment.values`, the same that GAE used) and R the GAE returns,

    L_t = 0.5 max((V_t - R_t)^2, (V_old_t + clip(V_t - V_old_t, -c, c) - R_t)^2),  c = cliprange_value

aggregated by `loss_agg_mode` over the batch's response tokens (token-mean by default).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from unirl.algorithms.base import StageAlgorithm
from unirl.algorithms.grpo import GRPO, GRPOConfig, text_segment
from unirl.algorithms.token_losses import LOSS_AGG_MODES, aggregate, masked_mean
from unirl.types.advantages import AdvantageConfig
from unirl.types.rollout_resp import RolloutTrack

RETURNS_KEY = "critic/returns"  # the GAE returns of a micro-batch, in track.conditions


@dataclass
class PPOConfig(GRPOConfig):
    """GRPO's settings with PPO's default pi_old: recomputed under the training weights before
    the first update (`old_logp_source: replay`, verl's), so that update's ratio is exactly 1."""

    old_logp_source: str = "replay"


class PPO(GRPO):
    """PPO on a text track: GRPO's clipped token loss on GAE advantages (`uses_values`: the recipe
    needs a `critic`, and `advantage.estimator: gae`, checked by `check_advantage`)."""

    uses_values: ClassVar[bool] = True

    def __init__(self, config: PPOConfig | None = None) -> None:
        super().__init__(config or PPOConfig())

    @staticmethod
    def check_advantage(advantage: AdvantageConfig) -> None:
        if advantage.estimator != "gae":
            raise ValueError(
                f"advantage.estimator={advantage.estimator!r}: PPO trains on the critic's GAE advantages; "
                "set advantage.estimator: gae"
            )


class ValueLoss(StageAlgorithm):
    """The critic's clipped value loss (module docstring) on a `CausalLMValueStage`-like stage
    (`token_values(segment)` -> [B, Rmax] fp32).

    Args:
        advantage: the run's advantage settings (gamma, lam, the KL folded into the reward): the
            returns are `RolloutTrack.value_targets(advantage)`, computed per micro-batch in
            `prepare_segment` (rows are independent, so they equal the batch's).
        cliprange_value: c, how far the clipped branch lets V move from V_old.
        loss_agg_mode: as the text policy losses' (`token_losses.aggregate`).
    """

    modality: ClassVar[str] = "text"
    supports_multi_update: ClassVar[bool] = True

    def __init__(
        self, advantage: AdvantageConfig, cliprange_value: float = 0.5, loss_agg_mode: str = "token-mean"
    ):
        if loss_agg_mode not in LOSS_AGG_MODES[:3]:
            raise ValueError(
                f"critic.loss_agg_mode must be one of {LOSS_AGG_MODES[:3]}, got {loss_agg_mode!r}"
            )
        self.advantage = advantage
        self.cliprange_value = cliprange_value
        self.loss_agg_mode = loss_agg_mode

    def prepare_segment(self, stage, track: RolloutTrack) -> RolloutTrack:
        returns = track.value_targets(self.advantage)
        return dataclasses.replace(track, conditions={**track.conditions, RETURNS_KEY: returns})

    def compute_loss_and_backward(self, stage, track: RolloutTrack, ctx: dict[str, Any]) -> dict[str, float]:
        seg = text_segment(track)
        values = stage.token_values(seg)
        device = values.device
        mask = seg.response_mask().to(device)
        old = seg.padded("values").to(device=device, dtype=values.dtype)
        returns = track.conditions[RETURNS_KEY].to(device=device, dtype=values.dtype)
        c = self.cliprange_value
        clipped = old + (values - old).clamp(-c, c)
        unclipped_err, clipped_err = (values - returns).square(), (clipped - returns).square()
        per_token = 0.5 * torch.maximum(unclipped_err, clipped_err)
        if "num_tokens" in ctx and "num_samples" in ctx:
            totals = (ctx["num_tokens"], ctx["num_samples"])
        else:
            totals = (mask.sum() / ctx["loss_scale"], mask.shape[0] / ctx["loss_scale"])
        loss = aggregate(per_token, mask, self.loss_agg_mode, *totals)
        loss.backward()
        return {
            "vf_loss": float(loss.detach()) / ctx["loss_scale"],
            "vf_clipfrac": float(masked_mean((clipped_err > unclipped_err).float(), mask)),
            "vpred_mean": float(masked_mean(values.detach(), mask)),
        }
