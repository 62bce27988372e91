"""Flow-GRPO: PPO-clipped policy gradient on per-step SDE log-prob ratios.

Per SDE step t of sample i, with r = exp(logp_new - logp_old) and advantage A:
    L = mean_{i,t} max(-A*r, -A*clip(r, 1-eps, 1+eps))
plus, when beta > 0, beta * mean_{i,t} KL_t with the Flow-GRPO estimate
    KL_t = mean_{non-batch}((mu_new - mu_ref)^2) / (2 * std_dev_t^2)
(the reference policy is the model with LoRA disabled; std_dev_t is the SDE's
sigma_t, flow_grpo's convention).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from unirl.algorithms.base import StageAlgorithm
from unirl.models.stage import DiffusionStage
from unirl.types.rollout_resp import RolloutTrack

CLIP_SCHEDULES = ("constant", "linear", "cosine")
OLD_LOGP_SOURCES = ("rollout", "replay")


@dataclass
class FlowGRPOConfig:
    """Flow-GRPO loss settings.

    Attributes:
        clip_range: PPO clip epsilon at the start of training.
        clip_range_final: epsilon at the end (linear / cosine schedule);
            None keeps `clip_range`.
        clip_schedule: "constant", "linear" or "cosine" in training progress.
        beta: KL coefficient to the reference policy (0 disables; no
            reference forward is run then).
        old_logp_source: "rollout" uses the log-probs recorded at sampling
            time; "replay" recomputes pi_old at the training geometry before
            the first update (the ratio is then exactly 1 on that update).
    """

    clip_range: float = 1e-4
    clip_range_final: float | None = None
    clip_schedule: str = "constant"
    beta: float = 0.0
    old_logp_source: str = "rollout"

    def __post_init__(self) -> None:
        if self.clip_schedule not in CLIP_SCHEDULES:
            raise ValueError(
                f"algorithm.config.clip_schedule must be one of {CLIP_SCHEDULES}, got {self.clip_schedule!r}"
            )
        if self.old_logp_source not in OLD_LOGP_SOURCES:
            raise ValueError(
                f"algorithm.config.old_logp_source must be one of {OLD_LOGP_SOURCES}, got {self.old_logp_source!r}"
            )
        if self.clip_range <= 0:
            raise ValueError(f"algorithm.config.clip_range must be > 0, got {self.clip_range}")
        if self.clip_range_final is not None and self.clip_range_final <= 0:
            raise ValueError(
                f"algorithm.config.clip_range_final must be > 0 or null, got {self.clip_range_final}"
            )
        if self.beta < 0:
            raise ValueError(f"algorithm.config.beta must be >= 0, got {self.beta}")

    def clip_at(self, progress: float) -> float:
        """Clip epsilon at training progress in [0, 1]."""
        end = self.clip_range if self.clip_range_final is None else self.clip_range_final
        p = min(max(progress, 0.0), 1.0)
        if self.clip_schedule == "constant":
            return self.clip_range
        if self.clip_schedule == "linear":
            return self.clip_range + (end - self.clip_range) * p
        return end + (self.clip_range - end) * 0.5 * (1 + math.cos(math.pi * p))


def clipped_policy_loss(
    new_logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, clip: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Elementwise PPO loss max(-A r, -A clip(r)) and the ratio r; shapes [B, k], adv [B]."""
    ratio = torch.exp(new_logp - old_logp)
    a = adv.unsqueeze(1)
    loss = torch.maximum(-a * ratio, -a * torch.clamp(ratio, 1 - clip, 1 + clip))
    return loss, ratio


class FlowGRPO(StageAlgorithm):
    """Flow-GRPO on a diffusion track (`LatentSegment` with SDE log-probs)."""

    modality: ClassVar[str] = "diffusion"
    supports_multi_update: ClassVar[bool] = True
    requires_ema_rollout: ClassVar[bool] = False
    requires_sde_logprobs: ClassVar[bool] = True

    def __init__(self, config: FlowGRPOConfig | None = None) -> None:
        self.config = config or FlowGRPOConfig()

    @property
    def needs_reference_policy(self) -> bool:
        return self.config.beta > 0

    @torch.no_grad()
    def prepare_segment(self, stage: DiffusionStage, track: RolloutTrack) -> RolloutTrack:
        seg = track.segment
        if not seg.sde_indices:
            raise ValueError(
                f"track {track.name!r} has no SDE steps (sampling.eta=0?): Flow-GRPO needs log-probs; "
                "set sampling.eta > 0"
            )
        if self.config.old_logp_source == "rollout":
            return track
        parts = [
            stage.replay(seg, track.conditions, steps)[0] for steps in stage.replay_chunks(seg.sde_indices)
        ]
        old = torch.cat(parts, dim=1)
        return dataclasses.replace(track, segment=dataclasses.replace(seg, log_probs=old))

    def compute_loss_and_backward(
        self, stage: DiffusionStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        """ctx: `loss_scale` (float), `progress` (float in [0, 1]), `reference`
        (a context-manager factory that switches the module to the reference policy)."""
        cfg = self.config
        seg = track.segment
        if track.advantages is None:
            raise ValueError(f"track {track.name!r} has no advantages: compute them before training")
        clip = cfg.clip_at(ctx["progress"])
        k_total = len(seg.sde_indices)
        sums = {
            "loss": 0.0,
            "policy_loss": 0.0,
            "kl": 0.0,
            "approx_kl": 0.0,
            "clipfrac": 0.0,
            "ratio_sum": 0.0,
        }
        rmin, rmax = math.inf, -math.inf
        for steps in stage.replay_chunks(seg.sde_indices):
            cols = [seg.sde_indices.index(i) for i in steps]
            if cfg.beta > 0:
                # Before the policy forward: a full fine-tune's reference swaps weights in place.
                with torch.no_grad(), ctx["reference"]():
                    _, ref_means, _ = stage.replay(seg, track.conditions, steps)
            new_logp, means, std_dev_t = stage.replay(seg, track.conditions, steps)
            old_logp = seg.log_probs[:, cols]
            per_elem, ratio = clipped_policy_loss(new_logp, old_logp, track.advantages, clip)
            policy = per_elem.mean()
            loss = policy
            if cfg.beta > 0:
                kl = ((means - ref_means) ** 2).mean(dim=(2, 3, 4)) / (2 * std_dev_t**2)
                loss = loss + cfg.beta * kl.mean()
                sums["kl"] += float(kl.detach().mean()) * len(steps)
            (loss * ctx["loss_scale"] * len(steps) / k_total).backward()
            loss, policy, new_logp, ratio = loss.detach(), policy.detach(), new_logp.detach(), ratio.detach()
            w = len(steps)
            sums["loss"] += float(loss) * w
            sums["policy_loss"] += float(policy) * w
            sums["approx_kl"] += float(0.5 * ((new_logp - old_logp) ** 2).mean()) * w
            sums["clipfrac"] += float(((ratio - 1).abs() > clip).float().mean()) * w
            sums["ratio_sum"] += float(ratio.mean()) * w
            rmin, rmax = min(rmin, float(ratio.min())), max(rmax, float(ratio.max()))
        out = {
            "loss": sums["loss"] / k_total,
            "policy_loss": sums["policy_loss"] / k_total,
            "approx_kl": sums["approx_kl"] / k_total,
            "clipfrac": sums["clipfrac"] / k_total,
            "ratio/mean": sums["ratio_sum"] / k_total,
            "ratio/min": rmin,
            "ratio/max": rmax,
            "clip_range": clip,
        }
        if cfg.beta > 0:
            out["kl"] = sums["kl"] / k_total
        return out
