"""Pure tensor pieces of the text policy losses (GRPO, DAPO, Dr.GRPO, GSPO, DRPO).

Shapes: per-token tensors are [B, R] (R the micro-batch's longest response),
right-padded; `mask` is [B, R] with 1 on response tokens and 0 on padding.
Log-probs are fp32. Nothing here reads a config or a stage.
"""

from __future__ import annotations

import typing
from typing import Literal

import torch

from unirl.algorithms.advantages import kl_penalty
from unirl.types.advantages import KL_ESTIMATORS

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "aggregate",
    "CORRECTION_MODES",
    "clipped_token_loss",
    "correction_weights",
    "kl_penalty",
    "log_ratio",
    "masked_mean",
    "mismatch_metrics",
    "ratio",
    "token_advantages",
]

LOG_RATIO_CLAMP = 20.0
LossAggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES = typing.get_args(LossAggMode)
CorrectionMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
CORRECTION_MODES = typing.get_args(CorrectionMode)


def log_ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """log r = clamp(logp - old_logp, -20, 20), elementwise (the clamp keeps exp finite)."""
    return torch.clamp(logp - old_logp, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)


def ratio(logp: torch.Tensor, old_logp: torch.Tensor) -> torch.Tensor:
    """r = exp(log_ratio(logp, old_logp)), elementwise."""
    return torch.exp(log_ratio(logp, old_logp))


def clipped_token_loss(
    r: torch.Tensor, adv: torch.Tensor, eps_low: float, eps_high: float, clip_ratio_c: float | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO's clipped loss per token, with asymmetric clip and optional dual clip.

        L = max(-A r, -A clip(r, 1 - eps_low, 1 + eps_high))
        dual clip (A < 0 only): L = min(L, -A c)

    Args:
        r: [B, R] ratios; adv: advantages broadcastable to r.
    Returns:
        (loss [B, R], clipped [B, R] bool: the clip term is the larger one,
        dual_clipped [B, R] bool: the dual clip bound applies; all False when c is None).
    """
    unclipped = -adv * r
    clipped = -adv * torch.clamp(r, 1 - eps_low, 1 + eps_high)
    loss = torch.maximum(unclipped, clipped)
    clip_active = clipped > unclipped
    if clip_ratio_c is None:
        return loss, clip_active, torch.zeros_like(clip_active)
    bound = -adv * clip_ratio_c
    dual_active = (adv < 0) & (loss > bound)
    return torch.where(dual_active, bound, loss), clip_active, dual_active


def aggregate(
    loss: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    num_tokens: float | None = None,
    num_samples: float | None = None,
    norm_constant: float | None = None,
) -> torch.Tensor:
    """Scalar from per-token losses [B, R] (verl's `loss_agg_mode` names).

        token-mean:              sum_{i,t} m L / N
        seq-mean-token-mean:     sum_i (sum_t m L / sum_t m) / S
        seq-mean-token-sum:      sum_i (sum_t m L) / S
        seq-mean-token-sum-norm: sum_i (sum_t m L / C) / S   (Dr.GRPO: C a constant, the max length)

    N and S default to this batch's token and sequence counts. Passing the totals of a
    larger batch (`num_tokens`, `num_samples`) makes this the batch's share: summing
    the shares of its micro-batches gives the batch aggregate exactly.
    """
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; choose one of {LOSS_AGG_MODES}")
    masked = loss * mask
    if mode == "token-mean":
        n = mask.sum() if num_tokens is None else num_tokens
        return masked.sum() / n
    s = mask.shape[0] if num_samples is None else num_samples
    per_seq = masked.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / mask.sum(dim=-1).clamp(min=1)
    elif mode == "seq-mean-token-sum-norm":
        if norm_constant is None:
            raise ValueError(
                "loss_agg_mode seq-mean-token-sum-norm needs norm_constant (the max response length)"
            )
        per_seq = per_seq / norm_constant
    return per_seq.sum() / s


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of x [B, R] over the valid tokens."""
    return (x * mask).sum() / mask.sum()


def token_advantages(adv: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[B, R] advantages for the tokens of `mask` [B, R]: a per-sample [B] broadcast to every
    token, or a per-token [B, R'] (R' >= R, right-padded) cut to the micro-batch's width."""
    b, width = mask.shape
    if adv.dim() == 1 and adv.shape[0] == b:
        return adv[:, None].expand(b, width)
    if adv.dim() == 2 and adv.shape[0] == b and adv.shape[1] >= width:
        return adv[:, :width]
    raise ValueError(
        f"advantages must be [B] or [B, >= Rmax] for a mask of {list(mask.shape)}, got {list(adv.shape)}"
    )


def correction_weights(
    old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor, mode: str, cap: float
) -> torch.Tensor:
    """[B, R] importance weights that correct the rollout-training mismatch (no gradient).

    The engine drew the tokens from pi_rollout (log-probs `rollout_logp`), the loss treats
    them as pi_old's (`old_logp`, the trainer's recomputation). With the per-token ratio
    rho_t = pi_old / pi_rollout = exp(old_logp_t - rollout_logp_t) (log clamped to +-20):

    - token_truncate: w_t = min(rho_t, cap) (truncated importance sampling);
    - token_mask: w_t = rho_t where rho_t <= cap, else 0 (masked importance sampling);
    - sequence_truncate: w_t = min(rho, cap) for every token of the sample, with the
      sequence ratio rho = exp(sum over the response of log rho_t);
    - sequence_mask: w_t = rho where rho <= cap, else 0, for every token of the sample.

    These are TRL's `vllm_importance_sampling_mode` options (`vllm_importance_sampling_cap`
    is `cap`) and verl's token / sequence rollout IS. Padding gets weight 0.
    """
    if mode not in CORRECTION_MODES:
        raise ValueError(f"rollout correction mode must be one of {CORRECTION_MODES}, got {mode!r}")
    log_rho = log_ratio(old_logp.detach(), rollout_logp.detach()) * mask
    if mode.startswith("sequence"):
        log_rho = log_ratio(log_rho.sum(dim=1, keepdim=True), torch.zeros(())).expand_as(mask)
    rho = torch.exp(log_rho)
    w = rho.clamp(max=cap) if mode.endswith("truncate") else torch.where(rho <= cap, rho, 0.0)
    return w * mask


def mismatch_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """How far the rollout engine's log-probs are from the trainer's on the same tokens:
    `mismatch/abs_diff_mean` and `/max` of |log pi_rollout - log pi_old| per token, and
    `mismatch/seq_kl`, the mean over samples of sum_t (log pi_rollout - log pi_old)
    (the k1 estimate of KL(pi_rollout || pi_old) of a whole response, the tokens being
    pi_rollout's samples)."""
    diff = (rollout_logp - old_logp).detach() * mask
    valid = mask.bool()
    return {
        "mismatch/abs_diff_mean": float(diff.abs()[valid].mean()),
        "mismatch/abs_diff_max": float(diff.abs()[valid].max()),
        "mismatch/seq_kl": float(diff.sum(dim=1).mean()),
    }
