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
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.distributed as dist

from unirl.algorithms.advantages import token_inputs, track_value_targets
from unirl.algorithms.base import StageAlgorithm
from unirl.algorithms.grpo import GRPO, GRPOConfig
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

    Config: ClassVar[type] = PPOConfig

    @staticmethod
    def check_advantage(advantage: AdvantageConfig) -> None:
        require_gae(advantage, "PPO trains on the critic's GAE advantages")


def require_gae(advantage: AdvantageConfig, why: str) -> None:
    """The check of a loss that trains on a critic's values (`uses_values`): return if
    `advantage.estimator` is gae, else raise ValueError `advantage.estimator=<its value>: <why>;
    set advantage.estimator: gae`."""
    if advantage.estimator != "gae":
        raise ValueError(f"advantage.estimator={advantage.estimator!r}: {why}; set advantage.estimator: gae")


class ValueNorm:
    """Running statistics of the critic's regression targets (MAPPO's ValueNorm): the critic
    predicts returns in units of (R - mu) / sigma, and the values it records are mapped back to
    reward units, so GAE and the driver never see the scale.

    After each step's returns R (all ranks' valid tokens or steps, all-reduced):

        m <- beta m + (1 - beta) mean(R),  q <- beta q + (1 - beta) mean(R^2),  w <- beta w + (1 - beta)
        mu = m / w,  sigma = sqrt(max(q / w - mu^2, 1e-8))

    (debiased exponential averages; before the first update mu = 0, sigma = 1). It matters when
    the rewards' spread is far below the critic's early error, as for a diffusion reward such as
    redness, whose batch std is about 0.01: whitened `r - V` is then the critic's noise.
    """

    def __init__(self, beta: float) -> None:
        if not 0 < beta < 1:
            raise ValueError(f"critic.value_norm_beta must be in (0, 1) or null, got {beta}")
        self.beta = beta
        self.m = self.q = self.w = 0.0

    @property
    def mean(self) -> float:
        return self.m / self.w if self.w > 0 else 0.0

    @property
    def std(self) -> float:
        return math.sqrt(max(self.q / self.w - self.mean**2, 1e-8)) if self.w > 0 else 1.0

    def update(self, returns: torch.Tensor) -> None:
        """Fold this step's returns [N] (this rank's; summed over ranks when distributed) in."""
        r = returns.detach().to(torch.float64)
        stats = torch.stack(
            [r.sum(), r.square().sum(), torch.tensor(float(r.numel()), dtype=torch.float64, device=r.device)]
        )
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(stats)
        total, squares, n = stats.tolist()
        b = self.beta
        self.m = b * self.m + (1 - b) * total / n
        self.q = b * self.q + (1 - b) * squares / n
        self.w = b * self.w + (1 - b)

    def normalize(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean) / self.std

    def denormalize(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.std + self.mean

    def state_dict(self) -> dict[str, float]:
        return {"m": self.m, "q": self.q, "w": self.w}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.m, self.q, self.w = state["m"], state["q"], state["w"]


class ValueLoss(StageAlgorithm):
    """The critic's clipped value loss (module docstring) on a value stage (`values(track)` ->
    [B, R] fp32: `CausalLMValueStage` per response token, `FlowValueStage` per SDE step; the
    mask and V_old are the track's `token_inputs`, so both modalities share this loss).

    Args:
        advantage: the run's advantage settings (gamma, lam, the KL folded into the reward): the
            returns are `track_value_targets(RolloutTrack, advantage)`, computed per micro-batch in
            `prepare_segment` (rows are independent, so they equal the batch's).
        cliprange_value: c, how far the clipped branch lets V move from V_old.
        loss_agg_mode: as the text policy losses' (`token_losses.aggregate`).
        norm: a `ValueNorm`: the stage's outputs are normalized values, and V, V_old and R enter
            the loss as (x - mu) / sigma (the clip range is then in those units); None: raw.
    """

    supports_multi_update: ClassVar[bool] = True

    def __init__(
        self,
        advantage: AdvantageConfig,
        cliprange_value: float = 0.5,
        loss_agg_mode: str = "token-mean",
        norm: ValueNorm | None = None,
    ):
        if loss_agg_mode not in LOSS_AGG_MODES[:3]:
            raise ValueError(
                f"critic.loss_agg_mode must be one of {LOSS_AGG_MODES[:3]}, got {loss_agg_mode!r}"
            )
        self.advantage = advantage
        self.cliprange_value = cliprange_value
        self.loss_agg_mode = loss_agg_mode
        self.norm = norm

    def prepare_segment(self, stage, track: RolloutTrack) -> RolloutTrack:
        returns = track_value_targets(track, self.advantage)
        return dataclasses.replace(track, conditions={**track.conditions, RETURNS_KEY: returns})

    def compute_loss_and_backward(self, stage, track: RolloutTrack, ctx: dict[str, Any]) -> dict[str, float]:
        values = stage.values(track)
        device = values.device
        inputs = token_inputs(track, self.advantage)
        mask = inputs["mask"].to(device=device, dtype=values.dtype)
        old = inputs["values"].to(device=device, dtype=values.dtype)
        returns = track.conditions[RETURNS_KEY].to(device=device, dtype=values.dtype)
        if self.norm is not None:
            old, returns = self.norm.normalize(old), self.norm.normalize(returns)
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
            "vpred_mean": float(masked_mean(self.raw(values.detach()), mask)),
        }

    def raw(self, values: torch.Tensor) -> torch.Tensor:
        """The stage's outputs in reward units (denormalized under a `ValueNorm`)."""
        return values if self.norm is None else self.norm.denormalize(values)

    def state_dict(self) -> dict[str, Any]:
        return {} if self.norm is None else {"value_norm": self.norm.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.norm is not None:
            self.norm.load_state_dict(state["value_norm"])
