"""GRPO for text: PPO's clipped token loss on group-relative advantages.

Per response token t of sample i, with r_t = exp(clamp(logp_t - logp_old_t, -20, 20)):
    L_t = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)),  then for A < 0: min(L_t, -A c)
aggregated by `loss_agg_mode` (see `token_losses.aggregate`), plus, when kl_coef > 0,
kl_coef * aggregate(kl_t) with kl_t the chosen estimator of KL(pi || pi_ref).

`TokenLossConfig` and `GRPO` also carry what the whole family shares (DAPO, Dr.GRPO,
GSPO, DRPO): the pi_old source, aggregation over the global batch, the KL loss term and
the metrics; a variant overrides `policy_loss`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar

import torch
from annotated_types import Ge, Gt

from unirl.algorithms.base import OldLogpSource, StageAlgorithm
from unirl.algorithms.token_losses import (
    CorrectionMode,
    LossAggMode,
    aggregate,
    clipped_token_loss,
    correction_weights,
    kl_penalty,
    masked_mean,
    mismatch_metrics,
    ratio,
    token_advantages,
)
from unirl.models.stage import TextStage
from unirl.types.advantages import KLEstimator
from unirl.types.constraints import NonNegative, OpenUnit, Positive, check_fields
from unirl.types.rollout_resp import RolloutTrack
from unirl.types.segments import TokenSegment


@dataclass
class TokenLossConfig:
    """Settings every text policy loss shares.

    Attributes:
        loss_agg_mode: "token-mean", "seq-mean-token-mean", "seq-mean-token-sum" or
            "seq-mean-token-sum-norm" (verl's names; `token_losses.aggregate`).
        norm_constant: the constant C of seq-mean-token-sum-norm, the max response
            length: set it to `${sampling.max_new_tokens}`. Required by that mode.
        kl_coef: weight of a KL-to-reference loss term (0 disables it and the
            reference forward). KL folded into the reward instead is
            `advantage.kl_coef`.
        kl_estimator: "k1", "k2", "k3" or "low_var_kl" (= k3) for the loss term.
        old_logp_source: "rollout" keeps the log-probs recorded at sampling time
            as pi_old (with a rollout engine such as vLLM this is the bypass mode: no
            recompute forward, the ratio is taken against the engine's policy);
            "replay" recomputes them under the training weights before the first
            update (the ratio is then exactly 1 on that update) and logs the
            rollout-training mismatch (`mismatch/*`, `token_losses.mismatch_metrics`).
        rollout_correction: null, or how the loss corrects for the engine having drawn
            the tokens from its own pi_rollout: "token_truncate", "token_mask",
            "sequence_truncate" or "sequence_mask" (`token_losses.correction_weights`);
            needs `old_logp_source: replay`.
        rollout_correction_cap: the cap C of those weights (>= 1).
    """

    loss_agg_mode: LossAggMode = "token-mean"
    norm_constant: Positive | None = None
    kl_coef: NonNegative = 0.0
    kl_estimator: KLEstimator = "low_var_kl"
    old_logp_source: OldLogpSource = "rollout"
    rollout_correction: CorrectionMode | None = None
    rollout_correction_cap: Annotated[float, Ge(1)] = 2.0  # an on-policy token has weight 1

    def __post_init__(self) -> None:
        check_fields(self, "algorithm.config.")
        if self.loss_agg_mode == "seq-mean-token-sum-norm" and self.norm_constant is None:
            raise ValueError(
                "algorithm.config.norm_constant must be set for loss_agg_mode seq-mean-token-sum-norm: "
                "the max response length, e.g. norm_constant: ${sampling.max_new_tokens}"
            )
        if self.rollout_correction is not None and self.old_logp_source != "replay":
            raise ValueError(
                f"algorithm.config.rollout_correction={self.rollout_correction!r} weighs the engine's "
                "samples by pi_old / pi_rollout, which needs the trainer's own pi_old: set "
                "algorithm.config.old_logp_source=replay (with rollout the ratio is already taken "
                "against the engine's log-probs)"
            )


@dataclass
class GRPOConfig(TokenLossConfig):
    """GRPO: the shared settings plus the clip.

    Attributes:
        eps_low, eps_high: the ratio is clipped to [1 - eps_low, 1 + eps_high].
        clip_ratio_c: dual clip for A < 0, the loss is capped at -A c (c > 1);
            null disables it.
    """

    eps_low: OpenUnit = 0.2
    eps_high: Positive = 0.2
    clip_ratio_c: Annotated[float, Gt(1)] | None = 3.0


def text_segment(track: RolloutTrack) -> TokenSegment:
    """The track's `TokenSegment`; raise naming the track otherwise."""
    if not isinstance(track.segment, TokenSegment):
        raise ValueError(
            f"track {track.name!r} holds a {type(track.segment).__name__}; text losses need a TokenSegment"
        )
    return track.segment


class GRPO(StageAlgorithm):
    """GRPO on a text track (`TokenSegment`, `stage.token_log_probs`).

    `compute_loss_and_backward` reads from ctx: `loss_scale` (1 / micro-batches),
    `reference` (context-manager factory switching to the reference policy; only with
    kl_coef > 0), and `num_tokens` / `num_samples`: the response tokens and samples of the
    global train batch divided by the world size. The micro-batch's loss is its share of
    the batch aggregate (`aggregate` with those totals), so summing over micro-batches
    (and averaging gradients over ranks) gives the exact batch loss for every
    `loss_agg_mode`. Without the totals in ctx each micro-batch is aggregated on its own
    and weighted by `loss_scale` (exact only when micro-batches hold equal token counts).
    """

    modality: ClassVar[str] = "text"
    supports_multi_update: ClassVar[bool] = True

    Config: ClassVar[type] = GRPOConfig

    @property
    def needs_reference_policy(self) -> bool:
        return self.config.kl_coef > 0

    @torch.no_grad()
    def prepare_segment(self, stage: TextStage, track: RolloutTrack) -> RolloutTrack:
        seg = text_segment(track)
        if self.config.old_logp_source == "rollout":
            return track
        old = stage.token_log_probs(seg).float()
        rows = [old[i, : lp.numel()].to(lp.device) for i, lp in enumerate(seg.log_probs)]
        segment = dataclasses.replace(seg, log_probs=rows, rollout_log_probs=seg.log_probs)
        return dataclasses.replace(track, segment=segment)

    def policy_loss(
        self, logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        """Per-token policy loss [B, R], the ratios [B, R] (for metrics) and loss-specific
        float metrics; all inputs [B, R] (`adv` broadcast to tokens)."""
        cfg = self.config
        r = ratio(logp, old_logp)
        loss, clipped, dual = clipped_token_loss(r, adv, cfg.eps_low, cfg.eps_high, cfg.clip_ratio_c)
        metrics = {"clipfrac": float(masked_mean(clipped.float(), mask))}
        if cfg.clip_ratio_c is not None:
            metrics["clipfrac_dual"] = float(masked_mean(dual.float(), mask))
        return loss, r, metrics

    def compute_loss_and_backward(
        self, stage: TextStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        cfg = self.config
        seg = text_segment(track)
        if track.advantages is None:
            raise ValueError(f"track {track.name!r} has no advantages: compute them before training")
        if cfg.kl_coef > 0:
            # before the policy forward: a full fine-tune's reference swaps weights in place
            with torch.no_grad(), ctx["reference"]():
                ref_logp = stage.token_log_probs(seg).float()
        logp = stage.token_log_probs(seg).float()
        device = logp.device
        mask = seg.response_mask().to(device=device, dtype=logp.dtype)
        old_logp = seg.padded("log_probs").to(device=device, dtype=logp.dtype)
        adv = token_advantages(track.advantages.to(device=device, dtype=logp.dtype), mask)
        if "num_tokens" in ctx and "num_samples" in ctx:
            totals = (ctx["num_tokens"], ctx["num_samples"])
        else:
            totals = (mask.sum() / ctx["loss_scale"], mask.shape[0] / ctx["loss_scale"])

        def agg(x: torch.Tensor) -> torch.Tensor:
            return aggregate(x, mask, cfg.loss_agg_mode, *totals, norm_constant=cfg.norm_constant)

        per_token, r, extra = self.policy_loss(logp, old_logp, adv, mask)
        if seg.rollout_log_probs is not None:  # pi_old replayed: the engine's log-probs kept beside it
            behaviour = seg.padded("rollout_log_probs").to(device=device, dtype=logp.dtype)
            extra.update(mismatch_metrics(old_logp, behaviour, mask))
            if cfg.rollout_correction is not None:
                w = correction_weights(old_logp, behaviour, mask, cfg.rollout_correction, cfg.rollout_correction_cap)
                per_token = per_token * w
                extra["rollout_is/weight_mean"] = float(masked_mean(w, mask))
                extra["rollout_is/zeroed_frac"] = float(masked_mean((w == 0).float(), mask))
        policy = agg(per_token)
        loss = policy
        if cfg.kl_coef > 0:
            kl = agg(kl_penalty(logp, ref_logp, cfg.kl_estimator))
            loss = loss + cfg.kl_coef * kl
        loss.backward()

        # the shares sum to the batch value over micro-batches; dividing by loss_scale makes
        # the stack's mean over micro-batches report that value
        scale = ctx["loss_scale"]
        valid = mask.bool()
        r, diff = r.detach()[valid], (logp.detach() - old_logp)[valid]
        out = {
            "loss": float(loss.detach()) / scale,
            "policy_loss": float(policy.detach()) / scale,
            "approx_kl": float(0.5 * diff.square().mean()),
            "ratio/mean": float(r.mean()),
            "ratio/min": float(r.min()),
            "ratio/max": float(r.max()),
            "response_length/mean": float(mask.sum(dim=1).mean()),
            **extra,
        }
        if cfg.kl_coef > 0:
            out["kl"] = float(kl.detach()) / scale
        return out
