"""CRD, Centered Reward Distillation (Zhu et al., arXiv 2603.14128): the policy's implicit
reward, read off its flow-matching error against an old snapshot, is matched to the external
reward after centring both within each prompt.

KL-regularised reward maximisation has the optimum pi* ~ pi_old exp(r / beta), so
r(x) = beta log(pi / pi_old)(x) + beta log Z(prompt). Parametrised as Flow-Factory's
`trainers/crd.py` (`CRDTrainer.optimize`, `_compute_crd_loss`), so its numbers (beta, kl_beta)
mean what they mean there. On the forward-process base (`forward_process.py`), per drawn
timestep j and sample i (c = `adv_clip`):
    e_ij    = (v_theta(x_s, s) - (eps - x0_i))^2                  (elementwise)
    rho_ij  = -mean(e_ij / sg(m_ij) - e_old,ij / m_old,ij)        (implicit reward)
    a_i     = clamp(clamp(A_i, -c, c) / (2c) + 1/2, 0, 1)         (advantage normalised to [0, 1])
with m = max(mean |v - target|, 1e-5) per row when `adaptive_logp` (Flow-Factory's default), else
m = 1 (rho = l_old - l); e_old under the old snapshot (no grad). The unknown log Z is the same for
every sample of a prompt, so both rewards are centred within the prompt, with weights w summing to
1 over its samples (`centering`) and no gradient through the centre:
    D_i(w)  = beta (rho_i - sg(sum_j w_j rho_j)) - (a_i - sum_j w_j a_j)
    M_j     = 1/2 mean_i [D_i(w+)^2 + D_i(w-)^2]    ("mse"; "bce": BCE-with-logits of the implicit
              centred reward beta (rho_i - sg(.)) against sigmoid(a_i - sum_j w_j a_j))
    uniform   w+ = w- = 1/n                       (plain centring, Flow-Factory's weight_temp < 0)
    softmax   w+ = softmax(a / tau), w- = softmax(-a / tau) within the group (weight_temp tau > 0)
    hard      ours: w+ uniform over the group's A > 0, w- over its A < 0 (an empty pool: uniform).
              Flow-Factory's weight_temp 0 compares the normalised a, in [0, 1], with 0: its
              positive pool is every sample with A > -c, its negative pool is always empty
    L       = mean_j [ c / beta * M_j + kl_beta mean_i k_i KL_ij ]
with KL_ij = mean (v_theta - v_ref)^2 to the frozen pretrained reference at `kl_guidance_scale`
(the paper anchors to the CFG-guided model, 4.5) and, when `kl_reward_adaptive`, k_i =
f + a_i (1 - f), f = 1e-4 / kl_beta (each sample's KL weighs with its normalised advantage, never
below 1e-4); else k_i = 1. Centring is within each prompt group (Flow-Factory centres over the
gathered micro-batch, which is one prompt's group when a micro-batch holds one group).

Snapshots: the old snapshot is an EMA of the policy kept by the train backend
(`snapshots`), decay min(d_max, d0 + slope t) per rollout (`old_decay`, the paper's
[0, 0.25, 0.005, 0.999]); the sampling snapshot is `train.ema` (rollouts come from it,
`requires_ema_rollout`), with the paper's schedule `schedule: linear, warmup_steps: 75,
decay_start: 0, decay_slope: 0.0075, decay: 0.999` (the live weights until step 75).
"""

from __future__ import annotations

import typing
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
from unirl.types.constraints import NonNegative, Positive
from unirl.types.rollout_resp import RolloutTrack

CRD_PREFIX = "crd/"
OLD_SNAPSHOT = CRD_PREFIX + "old"
Centering = Literal["uniform", "hard", "softmax"]
CENTERINGS = typing.get_args(Centering)
LossType = Literal["mse", "bce"]
KL_FLOOR = 1e-4  # the reward-adaptive KL weight's floor (Flow-Factory's base_beta)
ERROR_FLOOR = 1e-5  # adaptive_logp's floor on a row's mean |v - target|


@dataclass
class CRDConfig(ForwardProcessConfig):
    """CRD settings (and `ForwardProcessConfig`'s: the training times and noise).

    Attributes:
        beta: the implicit reward's scale (> 0; Flow-Factory's crd_beta, default 1): the
            matching stops once beta times the centred implicit reward equals the centred
            normalised advantage, so a larger beta moves the policy less per rollout.
        loss_type: "mse" or "bce" (module docstring).
        adaptive_logp: divide each row's squared errors by its mean |v - target| (no grad).
        centering: "uniform", "hard" or "softmax" (module docstring).
        temperature: tau of "softmax" (> 0), on the normalised advantages in [0, 1].
        old_decay: the old snapshot's decay [start_step, d0, slope, d_max] per rollout.
        adv_clip: c; advantages are clipped to +-c and normalised to [0, 1] by it.
        kl_beta: weight of the KL to the frozen reference (the paper's 0.1); 0: off.
        kl_reward_adaptive: weigh each sample's KL by its normalised advantage (floor 1e-4).
        kl_space: "velocity" or "latent".
        kl_guidance_scale: the reference's CFG scale (null: the rollout's); > 1 needs a
            guided rollout.
        train_guidance_scale: the CFG scale of the policy's and old snapshot's forwards
            (null: the rollout's).
    """

    timestep_distribution: TimestepDistribution = "discrete"
    timestep_range: tuple[float, float] = (0.01, 1.0)
    beta: Positive = 1.0
    loss_type: LossType = "mse"
    adaptive_logp: bool = True
    centering: Centering = "uniform"
    temperature: Positive = 1.0
    old_decay: tuple[float, float, float, float] = (0, 0.25, 0.005, 0.999)
    adv_clip: Positive = 5.0
    kl_beta: NonNegative = 0.1
    kl_reward_adaptive: bool = True
    kl_space: KLSpace = "velocity"
    kl_guidance_scale: Positive | None = None
    train_guidance_scale: Positive | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.old_decay = tuple(self.old_decay)
        decay_schedule(self.old_decay, "algorithm.config.old_decay", "rollout")


def normalised_advantages(adv: torch.Tensor, clip: float) -> torch.Tensor:
    """[B] a = clamp(clamp(A, -c, c) / (2c) + 1/2, 0, 1), the advantages in [0, 1]."""
    return (adv.float().clamp(-clip, clip) / clip / 2 + 0.5).clamp(0.0, 1.0)


def implicit_rewards(
    v: torch.Tensor, v_old: torch.Tensor, target: torch.Tensor, draws: int, adaptive: bool
) -> torch.Tensor:
    """[B, draws] rho = -mean(e / sg(m) - e_old / m_old) (module docstring); v, v_old and target
    [B * draws, ...], draw-major within a sample."""
    dims = tuple(range(1, v.dim()))
    v, v_old = v.float(), v_old.float()
    e, e_old = (v - target) ** 2, (v_old - target) ** 2
    if adaptive:
        with torch.no_grad():
            m = (v - target).abs().mean(dim=dims, keepdim=True).clamp(min=ERROR_FLOOR)
            m_old = (v_old - target).abs().mean(dim=dims, keepdim=True).clamp(min=ERROR_FLOOR)
        e, e_old = e / m, e_old / m_old
    return -(e - e_old).mean(dim=dims).view(-1, draws)


def centering_weights(
    a: torch.Tensor, mode: str, temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(w+, w-) [n] of one group's normalised advantages `a` [n] (in [0, 1]), each summing to 1
    (module docstring; `hard` pools by the advantage's sign, a > 1/2 and a < 1/2)."""
    n = len(a)
    uniform = torch.full_like(a, 1.0 / n)
    if mode == "uniform":
        return uniform, uniform
    if mode == "softmax":
        return torch.softmax(a / temperature, dim=0), torch.softmax(-a / temperature, dim=0)
    if mode == "hard":
        pools = []
        for mask in (a > 0.5, a < 0.5):
            pools.append(mask.to(a.dtype) / mask.sum() if mask.any() else uniform)
        return pools[0], pools[1]
    raise ValueError(f"algorithm.config.centering must be one of {CENTERINGS}, got {mode!r}")


def centred_match_loss(
    rho: torch.Tensor,
    a: torch.Tensor,
    group_ids: list[str],
    beta: float,
    mode: str,
    temperature: float = 1.0,
    loss_type: str = "mse",
) -> torch.Tensor:
    """Scalar M = 1/2 mean_i [D_i(w+)^2 + D_i(w-)^2] (or the BCE form), each sample centred
    within its group G with the weights of G's normalised advantages; rho and a [B]."""
    idx, n_groups = group_index(group_ids)
    total = rho.new_zeros(())
    for gi in range(n_groups):
        members = (idx == gi).nonzero().squeeze(1)
        r, t = rho[members], a[members]
        for w in centering_weights(t, mode, temperature):
            implicit = beta * (r - (w * r).sum().detach())
            external = t - (w * t).sum()
            if loss_type == "mse":
                total = total + 0.5 * ((implicit - external) ** 2).sum()
            else:
                total = total + 0.5 * F.binary_cross_entropy_with_logits(
                    implicit, torch.sigmoid(external), reduction="sum"
                )
    return total / len(rho)


class CRD(ForwardProcessAlgorithm):
    """Centered Reward Distillation on a diffusion track: final latents, rewards and advantages."""

    compares_within_groups: ClassVar[bool] = True
    requires_ema_rollout: ClassVar[bool] = True
    prefix: ClassVar[str] = CRD_PREFIX

    Config: ClassVar[type] = CRDConfig

    @property
    def needs_reference_policy(self) -> bool:
        return self.config.kl_beta > 0

    @property
    def snapshots(self) -> dict[str, dict[str, Any]]:
        return {OLD_SNAPSHOT: decay_schedule(self.config.old_decay, "algorithm.config.old_decay", "rollout")}

    @torch.no_grad()
    def prepare_segment(self, stage: DiffusionStage, track: RolloutTrack) -> RolloutTrack:
        """Draw (s, eps) per sample (or group), reused by every update of the rollout."""
        return self.with_draws(track)

    def compute_loss_and_backward(
        self, stage: DiffusionStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        """ctx: `loss_scale`; `snapshots` (the old snapshot); `reference` with `kl_beta > 0`.
        `track` holds whole prompt groups, with advantages. Returns `loss` (L's value),
        `policy_loss` (c / beta * mean_j M_j), `crd/match` (mean_j M_j) and the other `crd/...`
        metrics."""
        cfg = self.config
        self.check_prepared(track, self.noise_key)
        x_t, _, sigma, cond = self.inputs(track)
        target, k = self.target(track), cfg.draws_per_sample
        seg_g = track.segment.guidance_scale
        g = seg_g if cfg.train_guidance_scale is None else cfg.train_guidance_scale
        kl_g = seg_g if cfg.kl_guidance_scale is None else cfg.kl_guidance_scale
        with torch.no_grad():  # before the policy forward: the swaps change weights in place
            with ctx["snapshots"][OLD_SNAPSHOT]():
                v_old = stage.velocity(x_t, sigma, cond, g)
            v_ref = None
            if cfg.kl_beta > 0:
                with ctx["reference"]():
                    v_ref = stage.velocity(x_t, sigma, cond, kl_g)
        v = stage.velocity(x_t, sigma, cond, g)
        rho = implicit_rewards(v, v_old, target, k, cfg.adaptive_logp)  # [B, k]
        a = normalised_advantages(track.advantages, cfg.adv_clip)
        match = torch.stack(
            [
                centred_match_loss(
                    rho[:, j], a, track.group_ids, cfg.beta, cfg.centering, cfg.temperature, cfg.loss_type
                )
                for j in range(k)
            ]
        ).mean()
        policy = cfg.adv_clip / cfg.beta * match
        loss = policy
        out: dict[str, float] = {}
        if v_ref is not None:
            kl = prediction_kl(v, v_ref, sigma, cfg.kl_space).view(-1, k)
            coef = torch.ones_like(a)
            if cfg.kl_reward_adaptive:
                floor = KL_FLOOR / cfg.kl_beta
                coef = floor + a * (1 - floor)
            loss = loss + cfg.kl_beta * (coef[:, None] * kl).mean()
            out.update({"kl": float(kl.detach().mean()), "crd/kl_coef": cfg.kl_beta * float(coef.mean())})
        (loss * ctx["loss_scale"]).backward()
        rho = rho.detach()
        return {
            "loss": float(loss.detach()),
            "policy_loss": float(policy.detach()),
            "crd/match": float(match.detach()),
            "crd/implicit_reward_mean": float(rho.mean()),
            "crd/implicit_reward_std": float(rho.std()) if rho.numel() > 1 else 0.0,
            "crd/error": float(draw_errors(v.detach(), target, k).mean()),
            "crd/error_old": float(draw_errors(v_old, target, k).mean()),
            "crd/sigma_mean": float(sigma.mean()),
            **out,
        }
