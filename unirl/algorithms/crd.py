"""CRD, Centered Reward Distillation (Zhu et al., arXiv 2603.14128): the policy's implicit
reward, read off its flow-matching error against an old snapshot, is matched to the external
reward after centring both within each prompt.

KL-regularised reward maximisation has the optimum pi* ~ pi_old exp(r / beta), so
r(x) = beta log(pi / pi_old)(x) + beta log Z(prompt). With the flow-matching error as the
log-likelihood surrogate, on the forward-process base (`forward_process.py`), per sample i:
    l_i     = mean (v_theta(x_s, s) - (eps - x0_i))^2       (over the latent and the draws)
    rho_i   = reward_beta (l_old,i - l_i)                    (implicit reward; l_old no grad)
    delta_i = rho_i - A_i                                   (A the track's advantage, clipped)
The unknown log Z is the same for every sample of a prompt, so it cancels when both rewards are
centred within the prompt with weights w summing to 1 (`centering`), in two directions:
    L_match = 1/2 mean_i [(delta_i - sum_j w+_j delta_j)^2 + (delta_i - sum_j w-_j delta_j)^2]
    uniform   w+ = w- = 1/n                       (plain centring)
    hard      w+ uniform over the group's A > 0, w- over its A < 0 (an empty pool: uniform)
    softmax   w+ = softmax(A / tau), w- = softmax(-A / tau) within the group
The advantage is the reward centred (and, with the grpo estimator, scaled) within its prompt,
so the target is the centred reward of the paper up to that scale.
    L = L_match + kl_beta * k_r * mean (v_theta - v_ref)^2
with v_ref the frozen pretrained reference at `kl_guidance_scale` (the paper anchors to the
CFG-guided model, 4.5) and k_r = clamp(mean reward of the micro-batch, 0, 1) when
`kl_reward_adaptive` (the KL weighs little while the reward is low, more as it rises).

Snapshots: the old snapshot is an EMA of the policy kept by the train backend
(`snapshots`), decay min(d_max, d0 + slope t) per rollout (`old_decay`, the paper's
[0, 0.25, 0.005, 0.999]); the sampling snapshot is `train.ema` (rollouts come from it,
`requires_ema_rollout`), with the paper's schedule `schedule: linear, warmup_steps: 75,
decay_start: 0, decay_slope: 0.0075, decay: 0.999` (the live weights until step 75).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from unirl.algorithms.awm import prediction_kl
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

CRD_PREFIX = "crd/"
OLD_SNAPSHOT = CRD_PREFIX + "old"
CENTERINGS = ("uniform", "hard", "softmax")


@dataclass
class CRDConfig(ForwardProcessConfig):
    """CRD settings (and `ForwardProcessConfig`'s: the training times and noise).

    Attributes:
        reward_beta: the scale of the implicit reward rho = reward_beta (l_old - l) (> 0);
            larger: the policy moves less from the old snapshot per unit of advantage.
        centering: "uniform", "hard" or "softmax" (module docstring).
        temperature: tau of "softmax" (> 0).
        old_decay: the old snapshot's decay [start_step, d0, slope, d_max] per rollout.
        adv_clip: advantages are clipped to +-adv_clip.
        kl_beta: weight of the KL to the frozen reference (the paper's 0.1); 0: off.
        kl_reward_adaptive: scale the KL weight by the micro-batch's mean reward in [0, 1].
        kl_space: "velocity" or "latent".
        kl_guidance_scale: the reference's CFG scale (null: the rollout's); > 1 needs a
            guided rollout.
        train_guidance_scale: the CFG scale of the policy's and old snapshot's forwards
            (null: the rollout's).
    """

    timestep_distribution: str = "discrete"
    timestep_range: tuple[float, float] = (0.01, 1.0)
    reward_beta: float = 1000.0
    centering: str = "uniform"
    temperature: float = 1.0
    old_decay: tuple[float, float, float, float] = (0, 0.25, 0.005, 0.999)
    adv_clip: float = 5.0
    kl_beta: float = 0.1
    kl_reward_adaptive: bool = True
    kl_space: str = "velocity"
    kl_guidance_scale: float | None = None
    train_guidance_scale: float | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if not (self.reward_beta > 0 and math.isfinite(self.reward_beta)):
            raise ValueError(f"algorithm.config.reward_beta must be > 0, got {self.reward_beta}")
        if self.centering not in CENTERINGS:
            raise ValueError(
                f"algorithm.config.centering must be one of {CENTERINGS}, got {self.centering!r}"
            )
        if not (self.temperature > 0 and math.isfinite(self.temperature)):
            raise ValueError(f"algorithm.config.temperature must be > 0, got {self.temperature}")
        self.old_decay = tuple(self.old_decay)
        decay_schedule(self.old_decay, "algorithm.config.old_decay", "rollout")
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


def centering_weights(
    adv: torch.Tensor, mode: str, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w+, w-) [n] of one group's advantages `adv` [n], each summing to 1 (module docstring)."""
    n = len(adv)
    uniform = torch.full_like(adv, 1.0 / n)
    if mode == "uniform":
        return uniform, uniform
    if mode == "softmax":
        return torch.softmax(adv / temperature, dim=0), torch.softmax(-adv / temperature, dim=0)
    if mode == "hard":
        pools = []
        for mask in (adv > 0, adv < 0):
            pools.append(mask.to(adv.dtype) / mask.sum() if mask.any() else uniform)
        return pools[0], pools[1]
    raise ValueError(f"algorithm.config.centering must be one of {CENTERINGS}, got {mode!r}")


def centred_match_loss(
    delta: torch.Tensor, adv: torch.Tensor, group_ids: list[str], mode: str, temperature: float = 1.0
) -> torch.Tensor:
    """Scalar 1/2 mean_i [(delta_i - w+ . delta_G)^2 + (delta_i - w- . delta_G)^2], the weights
    of each sample's group G from its advantages; delta and adv [B]."""
    idx, n_groups = group_index(group_ids)
    total = delta.new_zeros(())
    for gi in range(n_groups):
        members = (idx == gi).nonzero().squeeze(1)
        d = delta[members]
        for w in centering_weights(adv[members], mode, temperature):
            total = total + 0.5 * ((d - (w * d).sum()) ** 2).sum()
    return total / len(delta)


class CRD(ForwardProcessAlgorithm):
    """Centered Reward Distillation on a diffusion track: final latents, rewards and advantages."""

    compares_within_groups: ClassVar[bool] = True
    requires_ema_rollout: ClassVar[bool] = True
    prefix: ClassVar[str] = CRD_PREFIX

    def __init__(self, config: CRDConfig | None = None) -> None:
        self.config = config or CRDConfig()

    @property
    def needs_reference_policy(self) -> bool:
        return self.config.kl_beta > 0

    @property
    def snapshots(self) -> dict[str, dict[str, Any]]:
        return {OLD_SNAPSHOT: decay_schedule(self.config.old_decay, "algorithm.config.old_decay", "rollout")}

    def check_sampling(self, sampling) -> None:
        super().check_sampling(sampling)
        check_guidance(
            sampling,
            train_guidance_scale=self.config.train_guidance_scale,
            kl_guidance_scale=self.config.kl_guidance_scale,
        )

    @torch.no_grad()
    def prepare_segment(self, stage: DiffusionStage, track: RolloutTrack) -> RolloutTrack:
        """Draw (s, eps) per sample (or group), reused by every update of the rollout."""
        return self.with_draws(track)

    def compute_loss_and_backward(
        self, stage: DiffusionStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        """ctx: `loss_scale`; `snapshots` (the old snapshot); `reference` with `kl_beta > 0`.
        `track` holds whole prompt groups, with rewards and advantages."""
        cfg = self.config
        if track.advantages is None or track.rewards is None:
            raise ValueError(f"track {track.name!r} has no rewards or advantages: score it before training")
        if self.noise_key not in track.conditions:
            raise ValueError(f"track {track.name!r} was not prepared: call prepare_segment before the loss")
        x_t, _, sigma, cond = self.inputs(track)
        target, k = self.target(track), cfg.draws_per_sample
        seg_g = track.segment.guidance_scale
        g = seg_g if cfg.train_guidance_scale is None else cfg.train_guidance_scale
        kl_g = seg_g if cfg.kl_guidance_scale is None else cfg.kl_guidance_scale
        with torch.no_grad():  # before the policy forward: the swaps change weights in place
            with ctx["snapshots"][OLD_SNAPSHOT]():
                err_old = sample_errors(stage.velocity(x_t, sigma, cond, g), target, k)
            v_ref = None
            if cfg.kl_beta > 0:
                with ctx["reference"]():
                    v_ref = stage.velocity(x_t, sigma, cond, kl_g)
        v = stage.velocity(x_t, sigma, cond, g)
        err = sample_errors(v, target, k)
        adv = track.advantages.float().clamp(-cfg.adv_clip, cfg.adv_clip)
        rho = cfg.reward_beta * (err_old - err)
        match = centred_match_loss(rho - adv, adv, track.group_ids, cfg.centering, cfg.temperature)
        loss = match
        out: dict[str, float] = {}
        if v_ref is not None:
            kl = prediction_kl(v, v_ref, sigma, cfg.kl_space).mean()
            k_r = float(track.rewards.float().mean().clamp(0.0, 1.0)) if cfg.kl_reward_adaptive else 1.0
            loss = loss + cfg.kl_beta * k_r * kl
            out.update({"kl": float(kl.detach()), "crd/kl_coef": cfg.kl_beta * k_r})
        (loss * ctx["loss_scale"]).backward()
        rho = rho.detach()
        return {
            "loss": float(loss.detach()),
            "policy_loss": float(match.detach()),
            "crd/implicit_reward_mean": float(rho.mean()),
            "crd/implicit_reward_std": float(rho.std()) if len(rho) > 1 else 0.0,
            "crd/error": float(err.detach().mean()),
            "crd/error_old": float(err_old.mean()),
            "crd/sigma_mean": float(sigma.mean()),
            **out,
        }
