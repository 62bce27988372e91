"""Pure tensor pieces of the text policy losses (GRPO, DAPO, Dr.GRPO, GSPO, DRPO).

Shapes: per-token tensors are [B, R] (R the micro-batch's longest response),
right-padded; `mask` is [B, R] with 1 on response tokens and 0 on padding.
Log-probs are fp32. Nothing here reads a config or a stage.
"""

from __future__ import annotations

import torch

from unirl.types.advantages import KL_ESTIMATORS, kl_penalty

__all__ = [
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "aggregate",
    "clipped_token_loss",
    "kl_penalty",
    "log_ratio",
    "masked_mean",
    "ratio",
    "token_advantages",
]

LOG_RATIO_CLAMP = 20.0
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")


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
