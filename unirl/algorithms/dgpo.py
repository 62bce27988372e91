"""DGPO, Direct Group Preference Optimization (Luo et al., arXiv 2510.08425): a DPO-style
preference loss between whole prompt groups, on the flow-matching errors of the final images.

Parametrised as the official code (Luo-Yihong/DGPO `scripts/train_sd3_dgpo.py`,
`compute_group_dgpo_loss_allreduce`; Flow-Factory `trainers/dgpo.py` has the same loss), so the
paper's beta and KL weight mean what they mean there. On the forward-process base
(`forward_process.py`; DGPO's draws: one (s, eps) shared by a group, `shared_noise: true`), per
drawn timestep j and sample i of group G (n_G of its samples in the micro-batch, A_i clipped to
+-adv_clip):
    l_ij  = mean (v_theta(x_s, s) - (eps - x0_i))^2          (over the latent)
    d_ij  = l_ij - l_ref,ij                                   (the reference's error, no grad)
    S_Gj  = beta / n_G * sum_{i in G} A_i d_ij                (no grad)
    L_j   = mean_i sigmoid(S_Gj) A_i l_ij  +  kl_beta mean_i (v_theta - v_kl)^2_ij
    L     = mean_j L_j                                        (one loss per draw, averaged)
Samples better than their group (A > 0) should have a lower error than the reference, worse
ones a higher one. The policy term's gradient is 1/beta times that of the group preference loss
mean_G -log sigmoid(-S_Gj) (each group's n_G equal): each sample's advantage-weighted matching
gradient, reweighted by a scalar of its whole group, so every update must hold complete groups
(class flag `compares_within_groups`: whole groups per micro-batch, and so per rank; refused
before Ray otherwise). With `clip_range` eps_c the official PPO-style clip: r_ij =
exp(l_old,ij - l_ij), l_old under the weights that sampled the batch (frozen in
`prepare_segment`); a row with A > 0 and r > 1 + eps_c, or A <= 0 and r < 1 - eps_c, trains on
sg(l_ij) (no gradient, same value), every other row on l_ij.

Reference (`reference`): `frozen` (LoRA disabled, or the initial weights; the paper's beta
10-100) or `ema`, a fast EMA of the policy with decay min(d_max, d0 + slope t) per optimizer
step (`ema_decay`, the official 0.3 cap and 1e-3 ramp; beta ~2000). The KL term is always to the
frozen reference, on velocities (the paper's) or latents (`kl_space`).

Published modes: CFG at rollout only (sampling.guidance_scale > 1, the loss unguided:
`train_guidance_scale: 1`) and CFG-free (sampling and loss unguided; a smaller clip range).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Literal

import torch
import torch.nn.functional as F

from unirl.algorithms.awm import prediction_kl
from unirl.algorithms.forward_process import (
    ForwardProcessAlgorithm,
    ForwardProcessConfig,
    TimestepDistribution,
    decay_schedule,
    draw_errors,
    group_index,
)
from unirl.algorithms.kl_control import KLSpace
from unirl.models.stage import DiffusionStage
from unirl.types.constraints import NonNegative, OpenUnit, Positive
from unirl.types.rollout_resp import RolloutTrack

DGPO_PREFIX = "dgpo/"
L_OLD_KEY = DGPO_PREFIX + "l_old"
EMA_REFERENCE = DGPO_PREFIX + "reference"
Reference = Literal["frozen", "ema"]


@dataclass
class DGPOConfig(ForwardProcessConfig):
    """DGPO settings (and `ForwardProcessConfig`'s: the training times and noise).

    Attributes:
        beta: the preference temperature (> 0), the official `beta_dpo`: 10-100 against a
            frozen reference, ~2000 against the fast EMA.
        reference: "frozen" or "ema" (module docstring).
        ema_decay: the EMA reference's decay [start_step, d0, slope, d_max] per optimizer step.
        clip_range: eps of the official clip on the matching term (1e-3..1e-2 with CFG at
            rollout only, 1e-5..1e-4 CFG-free); null: no clip.
        adv_clip: advantages are clipped to +-adv_clip.
        kl_beta: weight of the KL to the frozen reference (the paper's 1e-3); 0: off.
        kl_space: "velocity" (the paper's) or "latent".
        train_guidance_scale: the CFG scale of the loss's forwards (1: unguided, both published
            modes); > 1 needs a guided rollout.
        kl_guidance_scale: the CFG scale of the KL reference's forward (null: train_guidance_scale).
    """

    timestep_distribution: TimestepDistribution = "discrete"
    timestep_range: tuple[float, float] = (0.4, 1.0)
    shared_noise: bool = True
    beta: Positive = 100.0
    reference: Reference = "frozen"
    ema_decay: tuple[float, float, float, float] = (0, 0.0, 1e-3, 0.3)
    clip_range: OpenUnit | None = None
    adv_clip: Positive = 5.0
    kl_beta: NonNegative = 0.0
    kl_space: KLSpace = "velocity"
    train_guidance_scale: Positive = 1.0
    kl_guidance_scale: Positive | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.ema_decay = tuple(self.ema_decay)
        decay_schedule(self.ema_decay, "algorithm.config.ema_decay", "optimizer_step")


def group_scores(adv: torch.Tensor, d: torch.Tensor, idx: torch.Tensor, beta: float) -> torch.Tensor:
    """[G, k] S_Gj = beta / n_G sum_{i in G} A_i d_ij; adv [B], d [B, k], idx [B] each sample's
    group (`group_index`: 0..G-1 in order of first appearance)."""
    n = int(idx.max()) + 1
    sizes = torch.bincount(idx, minlength=n).to(d.dtype)
    sums = torch.zeros(n, d.shape[1], dtype=d.dtype).index_add(0, idx, adv[:, None] * d)
    return beta * sums / sizes[:, None]


def clipped_rows(ratio: torch.Tensor, adv: torch.Tensor, clip_range: float) -> torch.Tensor:
    """[B, k] bool, the rows the official clip stops: A > 0 and r > 1 + eps, or A <= 0 and
    r < 1 - eps; ratio [B, k], adv [B]."""
    return torch.where(adv[:, None] > 0, ratio > 1.0 + clip_range, ratio < 1.0 - clip_range)


class DGPO(ForwardProcessAlgorithm):
    """Direct Group Preference Optimization on a diffusion track: final latents and advantages."""

    compares_within_groups: ClassVar[bool] = True
    prefix: ClassVar[str] = DGPO_PREFIX

    Config: ClassVar[type] = DGPOConfig

    @property
    def needs_reference_policy(self) -> bool:
        return self.config.reference == "frozen" or self.config.kl_beta > 0

    @property
    def snapshots(self) -> dict[str, dict[str, Any]]:
        if self.config.reference != "ema":
            return {}
        return {
            EMA_REFERENCE: decay_schedule(
                self.config.ema_decay, "algorithm.config.ema_decay", "optimizer_step"
            )
        }

    @torch.no_grad()
    def prepare_segment(self, stage: DiffusionStage, track: RolloutTrack) -> RolloutTrack:
        """Draw (s, eps) per group (or sample); with the clip, freeze l_old under the sampling weights."""
        track = self.with_draws(track)
        if self.config.clip_range is not None:
            x_t, _, sigma, cond = self.inputs(track)
            v_old = stage.velocity(x_t, sigma, cond, self.config.train_guidance_scale)
            track.conditions[L_OLD_KEY] = draw_errors(v_old, self.target(track), self.config.draws_per_sample)
        return track

    def compute_loss_and_backward(
        self, stage: DiffusionStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        """ctx: `loss_scale`; `reference` (frozen reference or KL); `snapshots` (the EMA reference).
        `track` holds whole prompt groups. Returns `loss` (L's value), `policy_loss` (its policy
        term), `dgpo/group_loss` (mean_Gj -log sigmoid(-S_Gj)) and the other `dgpo/...` metrics."""
        cfg = self.config
        self.check_prepared(track, self.noise_key)
        x_t, _, sigma, cond = self.inputs(track)
        target, k, g = self.target(track), cfg.draws_per_sample, cfg.train_guidance_scale
        kl_g = g if cfg.kl_guidance_scale is None else cfg.kl_guidance_scale
        with torch.no_grad():  # before the policy forward: the swaps change weights in place
            swap = ctx["reference"] if cfg.reference == "frozen" else ctx["snapshots"][EMA_REFERENCE]
            with swap():
                v_ref = stage.velocity(x_t, sigma, cond, g)
            v_kl = None
            if cfg.kl_beta > 0:
                if cfg.reference == "frozen" and kl_g == g:
                    v_kl = v_ref
                else:
                    with ctx["reference"]():
                        v_kl = stage.velocity(x_t, sigma, cond, kl_g)
        v = stage.velocity(x_t, sigma, cond, g)
        err = draw_errors(v, target, k)  # [B, k]
        err_ref = draw_errors(v_ref, target, k)
        adv = track.advantages.float().clamp(-cfg.adv_clip, cfg.adv_clip)
        idx, _ = group_index(track.group_ids)
        scores = group_scores(adv, (err - err_ref).detach(), idx, cfg.beta)  # [G, k]
        weights = torch.sigmoid(scores)
        out: dict[str, float] = {}
        matched = err
        if cfg.clip_range is not None:
            ratio = torch.exp(track.conditions[L_OLD_KEY] - err).detach()
            clipped = clipped_rows(ratio, adv, cfg.clip_range)
            matched = torch.where(clipped, err.detach(), err)
            out.update(
                {
                    "ratio/mean": float(ratio.mean()),
                    "ratio/min": float(ratio.min()),
                    "ratio/max": float(ratio.max()),
                    "clipfrac": float(clipped.float().mean()),
                }
            )
        policy = (weights[idx] * adv[:, None] * matched).mean()  # mean over samples, then draws
        total = policy
        if v_kl is not None:
            kl = prediction_kl(v, v_kl, sigma, cfg.kl_space).mean()
            total = total + cfg.kl_beta * kl
            out["kl"] = float(kl.detach())
        (total * ctx["loss_scale"]).backward()
        return {
            "loss": float(total.detach()),
            "policy_loss": float(policy.detach()),
            "dgpo/group_loss": float(-F.logsigmoid(-scores).mean()),
            "dgpo/group_sum_mean": float(scores.mean()),
            "dgpo/group_sum_abs": float(scores.abs().mean()),
            "dgpo/group_weight": float(weights.mean()),
            "dgpo/error": float(err.detach().mean()),
            "dgpo/error_ref": float(err_ref.mean()),
            "dgpo/sigma_mean": float(sigma.mean()),
            **out,
        }
