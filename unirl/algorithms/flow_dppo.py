"""Flow-DPPO (Ping et al., 2026): a divergence mask in place of PPO's ratio clip.

The old (rollout) and current policies of an SDE step are Gaussians with the same
transition std s_t, so their KL is exact. Per SDE step t of sample i, with
r = exp(logp_new - logp_old) and advantage A:
    D_t  = mean_{non-batch}((mu_new - mu_old)^2) / (2 s_t^2)
    drop = D_t >= tau  and  ((r > 1 and A > 0) or (r < 1 and A < 0))
    L    = mean_{i,t} (-A r) * [not drop]
A step is dropped only when it is both far from pi_old and still moving further in
its advantage's direction; corrective moves always pass. D_t is mean-reduced over
the latent's elements, so tau (1e-5 in the paper's code) is calibrated per element.
mu_old is replayed under the weights that sampled the batch before the first update
and frozen (`track.conditions["dppo/old_means"]`); an optional KL to the reference
(`beta`, fixed or adaptive) uses the same exact KL.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from unirl.algorithms.flow_grpo import FlowGRPO, StepChunk, StepLossConfig
from unirl.algorithms.kl_control import step_kl
from unirl.models.stage import DiffusionStage
from unirl.types.constraints import Positive
from unirl.types.rollout_resp import RolloutTrack

OLD_MEANS_KEY = "dppo/old_means"


@dataclass
class FlowDPPOConfig(StepLossConfig):
    """Flow-DPPO settings (and `StepLossConfig`'s).

    Attributes:
        kl_threshold: tau, the per-step divergence D_t (mean over the latent's
            elements) from which updates moving away from pi_old are masked.
    """

    kl_threshold: Positive = 1e-5


def dppo_policy_loss(
    new_logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor, divergence: torch.Tensor, tau: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Elementwise masked loss (-A r) * keep, the ratio r and the drop mask; new_logp,
    old_logp and divergence [B, k], adv [B]."""
    ratio = torch.exp(new_logp - old_logp)
    a = adv.unsqueeze(1)
    away = ((ratio > 1) & (a > 0)) | ((ratio < 1) & (a < 0))
    drop = (divergence.detach() >= tau) & away.detach()
    # where, not a product: a dropped step with an overflowing ratio must not give 0 * inf
    loss = torch.where(drop, torch.zeros_like(ratio), -a * ratio)
    return loss, ratio, drop


class FlowDPPO(FlowGRPO):
    """Flow-DPPO on a diffusion track (`LatentSegment` with SDE log-probs)."""

    frozen_keys: ClassVar[tuple[str, ...]] = (OLD_MEANS_KEY,)
    supports_kept_graph: ClassVar[bool] = False  # prepare_segment replays mu_old itself

    Config: ClassVar[type] = FlowDPPOConfig

    @torch.no_grad()
    def prepare_segment(self, stage: DiffusionStage, track: RolloutTrack) -> RolloutTrack:
        """Freeze mu_old (and, with `old_logp_source: replay`, logp_old) under the weights
        that sampled the batch, before any update."""
        self.check_sde_steps(track)
        seg = track.segment
        cond = self.replay_conditions(track)
        logps, means = [], []
        for steps in stage.replay_chunks(seg.sde_indices, seg):
            logp, mean, _ = stage.replay(seg, cond, steps)
            logps.append(logp)
            means.append(mean)
        if self.config.old_logp_source == "replay":
            seg = dataclasses.replace(seg, log_probs=torch.cat(logps, dim=1))
        conditions = {**track.conditions, OLD_MEANS_KEY: torch.cat(means, dim=1)}
        return dataclasses.replace(track, segment=seg, conditions=conditions)

    def policy_loss(
        self, chunk: StepChunk, track: RolloutTrack, adv: torch.Tensor, ctx: dict[str, Any]
    ) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
        if OLD_MEANS_KEY not in track.conditions:
            raise ValueError(f"track {track.name!r} was not prepared: call prepare_segment before the loss")
        old_means = track.conditions[OLD_MEANS_KEY][:, chunk.cols]
        divergence = step_kl(chunk.means.detach(), old_means, chunk.transition_std)
        loss, ratio, drop = dppo_policy_loss(
            chunk.new_logp, chunk.old_logp, adv, divergence, self.config.kl_threshold
        )
        return (
            loss,
            ratio,
            {
                "dppo/kl_old": float(divergence.mean()),
                "dppo/kl_old/max": float(divergence.max()),
                "dppo/over_threshold_frac": float((divergence >= self.config.kl_threshold).float().mean()),
                "dppo/masked_frac": float(drop.float().mean()),
            },
        )

    def kl_scale(self, chunk: StepChunk) -> torch.Tensor:
        """The transition std: the exact Gaussian KL of the step."""
        return chunk.transition_std
