"""DGPO, Direct Group Preference Optimization (Luo et al., arXiv 2510.08425): a DPO-style
preference loss between whole prompt groups, on the flow-matching errors of the final images.

On the forward-process base (`forward_process.py`; DGPO's draws: one (s, eps) shared by a
group, `shared_noise: true`), per sample i with advantage A_i (clipped to +-adv_clip):
    l_i     = mean (v_theta(x_s, s) - (eps - x0_i))^2      (over the latent and the draws)
    d_i     = l_i - l_ref,i                                 (the reference's error, no grad)
    S_G     = sum_{i in G} A_i d_i
    L       = mean_G -log sigmoid(-beta S_G)  +  kl_beta mean (v_theta - v_kl)^2
Samples better than their group (A > 0) should have a lower error than the reference, worse
ones a higher one. The gradient of a group's term is c_G sum_i A_i grad l_i with
c_G = beta sigmoid(beta S_G): each sample's advantage-weighted matching gradient, reweighted by
a scalar of its whole group, so every update must hold complete groups (class flag
`compares_within_groups`: whole groups per micro-batch, and so per rank; refused before Ray
otherwise). With `clip_range` eps_c the matching term is PPO-clipped as AWM's
(`awm_policy_loss`): sum_i sg(c_G) max(-A_i r_i, -A_i clip(r_i, 1 - eps_c, 1 + eps_c)),
r_i = exp(l_old,i - l_i), l_old under the weights that sampled the batch (frozen in
`prepare_segment`); at r = 1 its gradient is the unclipped one.

Reference (`reference`): `frozen` (LoRA disabled, or the initial weights; the paper's beta
10-100) or `ema`, a fast EMA of the policy with decay min(d_max, d0 + slope t) per optimizer
step (`ema_decay`, Flow-Factory's 0.3 cap and 1e-3 ramp; beta ~2000). The KL term is always to
the frozen reference, on velocities (the paper's) or latents (`kl_space`).

Published modes: CFG at rollout only (sampling.guidance_scale > 1, the loss unguided:
`train_guidance_scale: 1`) and CFG-free (sampling and loss unguided; a smaller clip range).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from unirl.algorithms.awm import awm_policy_loss, prediction_kl
from unirl.algorithms.forward_process import (
    ForwardProcessAlgorithm,
    ForwardProcessConfig,
    check_guidance,
    decay_schedule,
    group_index,
    sample_errors,
)
from unirl.algorithms.kl_control import KL_SPACES
from unirl.models.stage import DiffusionStage
from unirl.types.rollout_resp import RolloutTrack

DGPO_PREFIX = "dgpo/"
L_OLD_KEY = DGPO_PREFIX + "l_old"
EMA_REFERENCE = DGPO_PREFIX + "reference"
REFERENCES = ("frozen", "ema")


@dataclass
class DGPOConfig(ForwardProcessConfig):
    """DGPO settings (and `ForwardProcessConfig`'s: the training times and noise).

    Attributes:
        beta: the preference temperature (> 0): 10-100 against a frozen reference, ~2000
            against the fast EMA.
        reference: "frozen" or "ema" (module docstring).
        ema_decay: the EMA reference's decay [start_step, d0, slope, d_max] per optimizer step.
        clip_range: eps of the PPO clip on the matching term (1e-3..1e-2 with CFG at rollout
            only, 1e-5..1e-4 CFG-free); null: no clip.
        adv_clip: advantages are clipped to +-adv_clip.
        kl_beta: weight of the KL to the frozen reference (the paper's 1e-3); 0: off.
        kl_space: "velocity" (the paper's) or "latent".
        train_guidance_scale: the CFG scale of the loss's forwards (1: unguided, both published
            modes); > 1 needs a guided rollout.
        kl_guidance_scale: the CFG scale of the KL reference's forward (null: train_guidance_scale).
    """

    timestep_distribution: str = "discrete"
    timestep_range: tuple[float, float] = (0.4, 1.0)
    shared_noise: bool = True
    beta: float = 100.0
    reference: str = "frozen"
    ema_decay: tuple[float, float, float, float] = (0, 0.0, 1e-3, 0.3)
    clip_range: float | None = None
    adv_clip: float = 5.0
    kl_beta: float = 0.0
    kl_space: str = "velocity"
    train_guidance_scale: float = 1.0
    kl_guidance_scale: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.beta > 0 and math.isfinite(self.beta)):
            raise ValueError(f"algorithm.config.beta must be > 0, got {self.beta}")
        if self.reference not in REFERENCES:
            raise ValueError(
                f"algorithm.config.reference must be one of {REFERENCES}, got {self.reference!r}"
            )
        self.ema_decay = tuple(self.ema_decay)
        decay_schedule(self.ema_decay, "algorithm.config.ema_decay", "optimizer_step")
        if self.clip_range is not None and not 0 < self.clip_range < 1:
            raise ValueError(
                f"algorithm.config.clip_range must be in (0, 1) or null (no clip), got {self.clip_range}"
            )
        if not self.adv_clip > 0:
            raise ValueError(f"algorithm.config.adv_clip must be > 0, got {self.adv_clip}")
        if not (self.kl_beta >= 0 and math.isfinite(self.kl_beta)):
            raise ValueError(f"algorithm.config.kl_beta must be >= 0, got {self.kl_beta}")
        if self.kl_space not in KL_SPACES:
            raise ValueError(f"algorithm.config.kl_space must be one of {KL_SPACES}, got {self.kl_space!r}")
        for key in ("train_guidance_scale", "kl_guidance_scale"):
            value = getattr(self, key)
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise ValueError(f"algorithm.config.{key} must be > 0, got {value}")


def group_sums(adv: torch.Tensor, d: torch.Tensor, group_ids: list[str]) -> torch.Tensor:
    """[G] S_G = sum_{i in G} A_i d_i over the groups of `group_ids` (order of first appearance)."""
    idx, n = group_index(group_ids)
    return torch.zeros(n, dtype=d.dtype).index_add(0, idx, adv * d)


class DGPO(ForwardProcessAlgorithm):
    """Direct Group Preference Optimization on a diffusion track: final latents and advantages."""

    compares_within_groups: ClassVar[bool] = True
    prefix: ClassVar[str] = DGPO_PREFIX

    def __init__(self, config: DGPOConfig | None = None) -> None:
        self.config = config or DGPOConfig()

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

    def check_sampling(self, sampling) -> None:
        super().check_sampling(sampling)
        check_guidance(
            sampling,
            train_guidance_scale=self.config.train_guidance_scale,
            kl_guidance_scale=self.config.kl_guidance_scale,
        )

    @torch.no_grad()
    def prepare_segment(self, stage: DiffusionStage, track: RolloutTrack) -> RolloutTrack:
        """Draw (s, eps) per group (or sample); with the clip, freeze l_old under the sampling weights."""
        track = self.with_draws(track)
        if self.config.clip_range is not None:
            x_t, _, sigma, cond = self.inputs(track)
            v_old = stage.velocity(x_t, sigma, cond, self.config.train_guidance_scale)
            track.conditions[L_OLD_KEY] = sample_errors(
                v_old, self.target(track), self.config.draws_per_sample
            )
        return track

    def compute_loss_and_backward(
        self, stage: DiffusionStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        """ctx: `loss_scale`; `reference` (frozen reference or KL); `snapshots` (the EMA reference).
        `track` holds whole prompt groups. Returns `loss` (the DGPO loss's value), its terms and
        `dgpo/...` metrics."""
        cfg = self.config
        if track.advantages is None:
            raise ValueError(f"track {track.name!r} has no advantages: compute them before training")
        if self.noise_key not in track.conditions:
            raise ValueError(f"track {track.name!r} was not prepared: call prepare_segment before the loss")
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
        err = sample_errors(v, target, k)
        err_ref = sample_errors(v_ref, target, k)
        adv = track.advantages.float().clamp(-cfg.adv_clip, cfg.adv_clip)
        idx, n_groups = group_index(track.group_ids)
        sums = group_sums(adv, (err - err_ref).detach(), track.group_ids)
        coef = cfg.beta * torch.sigmoid(cfg.beta * sums)  # d L_G / d S_G
        if cfg.clip_range is None:
            per_sample, ratio = adv * err, None
        else:
            per_sample, ratio = awm_policy_loss(err, track.conditions[L_OLD_KEY], adv, cfg.clip_range)
        surrogate = (coef[idx] * per_sample).sum() / n_groups
        group_loss = -F.logsigmoid(-cfg.beta * sums).mean()
        out: dict[str, float] = {}
        total = surrogate
        if v_kl is not None:
            kl = prediction_kl(v, v_kl, sigma, cfg.kl_space).mean()
            total = total + cfg.kl_beta * kl
            out["kl"] = float(kl.detach())
        (total * ctx["loss_scale"]).backward()
        if ratio is not None:
            ratio = ratio.detach()
            out.update(
                {
                    "ratio/mean": float(ratio.mean()),
                    "ratio/min": float(ratio.min()),
                    "ratio/max": float(ratio.max()),
                    "clipfrac": float(((ratio - 1).abs() > cfg.clip_range).float().mean()),
                }
            )
        return {
            "loss": float(group_loss) + cfg.kl_beta * out.get("kl", 0.0),
            "policy_loss": float(group_loss),
            "dgpo/group_sum_mean": float(sums.mean()),
            "dgpo/group_sum_abs": float(sums.abs().mean()),
            "dgpo/group_weight": float(coef.mean()),
            "dgpo/error": float(err.detach().mean()),
            "dgpo/error_ref": float(err_ref.mean()),
            "dgpo/sigma_mean": float(sigma.mean()),
            **out,
        }
