"""AWM, Advantage Weighted Matching (Xue et al., arXiv 2509.25050): the pretraining
flow-matching loss, each sample weighted by its advantage.

On the forward-process base (`forward_process.py`: s and eps drawn apart from the sampler,
x_s = (1 - s) x0 + s eps, target eps - x0), per row (sample, draw):
    l = mean_{C,h,w} (v_theta(x_s, s) - (eps - x0))^2
    w = l            uniform
        s l          t
        s^2 l        t**2
        s (sqrt(l + e) - sqrt(e))                huber
        s ((l + e)^p - e^p) / p                  ghuber (power p)
with e = 1e-10 (the offsets change no gradient). With w_old the same row under the weights
that sampled the batch (frozen in `prepare_segment`), r = exp(w_old - w) and A the advantage
clipped to +-adv_clip:
    L = mean max(-A r, -A clip(r, 1 - eps_c, 1 + eps_c))      (clip_range eps_c; null: -A r)
      + ema_kl_beta * mean KL(theta || EMA)  + beta * mean KL(theta || reference)
At r = 1 (the first update) the policy term's gradient is mean(A grad w): positive
advantages pull the velocity toward the sample's flow-matching target, negative ones push
it away. That is fast and, unconstrained, collapses: the clip and the KL to an EMA of the
policy are the paper's constraints, and a recipe with neither is refused unless it says
`allow_unconstrained: true`.

KL (`kl_space`): `velocity` mean (v_theta - v_other)^2 (the paper's); `latent` the same on
the clean-latent predictions x_s - s v, i.e. s^2 times it.
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal

import torch
from annotated_types import Interval

from unirl.algorithms.forward_process import (
    ForwardProcessAlgorithm,
    ForwardProcessConfig,
    TimestepDistribution,
)
from unirl.algorithms.kl_control import KLSpace
from unirl.models.stage import DiffusionStage
from unirl.types.constraints import NonNegative, OpenUnit, Positive
from unirl.types.rollout_resp import RolloutTrack

AWM_PREFIX = "awm/"
W_OLD_KEY = AWM_PREFIX + "w_old"
Weighting = Literal["uniform", "t", "t**2", "huber", "ghuber"]
WEIGHTINGS = typing.get_args(Weighting)
HUBER_EPS = 1e-10


@dataclass
class AWMConfig(ForwardProcessConfig):
    """AWM settings (and `ForwardProcessConfig`'s: the training times and noise).

    Attributes:
        weighting: "uniform", "t", "t**2", "huber" or "ghuber" (module docstring).
        ghuber_power: p of "ghuber", in (0, 1] (the paper's 0.25).
        clip_range: eps of the PPO clip on r (the paper's 1e-5); null: no clip.
        adv_clip: advantages are clipped to +-adv_clip (5.0).
        ema_kl_beta: weight of the KL to the EMA of the policy (the paper's 0.1; needs
            `train.ema`, the paper's decay 0.9); 0: off.
        beta: weight of the KL to the reference policy (LoRA disabled, or the frozen
            initial weights); 0: off.
        kl_space: "velocity" or "latent" (module docstring), for both KL terms.
        allow_unconstrained: accept clip_range null with both KL weights 0 (collapses
            without a constraint; for ablations).
    """

    timestep_distribution: TimestepDistribution = "discrete"
    weighting: Weighting = "uniform"
    ghuber_power: Annotated[float, Interval(gt=0, le=1)] = 0.25
    clip_range: OpenUnit | None = 1e-5
    adv_clip: Positive = 5.0
    ema_kl_beta: NonNegative = 0.0
    beta: NonNegative = 0.0
    kl_space: KLSpace = "velocity"
    allow_unconstrained: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        if (
            self.clip_range is None
            and self.ema_kl_beta == 0
            and self.beta == 0
            and not self.allow_unconstrained
        ):
            raise ValueError(
                "algorithm.config: AWM with neither constraint (clip_range: null, ema_kl_beta: 0, beta: 0) "
                "collapses; set clip_range (the paper's 1e-5), ema_kl_beta > 0 (the paper's 0.1, with train.ema) "
                "or beta > 0, or allow_unconstrained: true to run it anyway"
            )


def matching_weight(
    err: torch.Tensor, sigma: torch.Tensor, weighting: str, power: float = 0.25
) -> torch.Tensor:
    """[N] w(l, s) of per-row flow-matching errors l = `err` [N] at noise levels s = `sigma` [N]."""
    if weighting == "uniform":
        return err
    if weighting == "t":
        return sigma * err
    if weighting == "t**2":
        return sigma**2 * err
    if weighting == "huber":
        return sigma * (torch.sqrt(err + HUBER_EPS) - math.sqrt(HUBER_EPS))
    if weighting == "ghuber":
        return sigma * ((err + HUBER_EPS) ** power - HUBER_EPS**power) / power
    raise ValueError(f"algorithm.config.weighting must be one of {WEIGHTINGS}, got {weighting!r}")


def awm_policy_loss(
    w: torch.Tensor, w_old: torch.Tensor, adv: torch.Tensor, clip: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """[N] max(-A r, -A clip(r, 1 - clip, 1 + clip)) (clip None: -A r) and r = exp(w_old - w);
    w, w_old and adv [N]."""
    ratio = torch.exp(w_old - w)
    if clip is None:
        return -adv * ratio, ratio
    return torch.maximum(-adv * ratio, -adv * torch.clamp(ratio, 1 - clip, 1 + clip)), ratio


def prediction_kl(v: torch.Tensor, v_other: torch.Tensor, sigma: torch.Tensor, space: str) -> torch.Tensor:
    """[N] mean (v - v_other)^2 over non-batch dims ("velocity"), times s^2 for the clean-latent
    predictions x_s - s v ("latent"); sigma [N]."""
    d = ((v - v_other) ** 2).mean(dim=tuple(range(1, v.dim())))
    return d if space == "velocity" else sigma**2 * d


class AWM(ForwardProcessAlgorithm):
    """Advantage Weighted Matching on a diffusion track: final latents and advantages only."""

    prefix: ClassVar[str] = AWM_PREFIX

    Config: ClassVar[type] = AWMConfig

    @property
    def needs_reference_policy(self) -> bool:
        return self.config.beta > 0

    @property
    def needs_ema(self) -> bool:
        """Whether the loss evaluates the EMA weights (validation then requires `train.ema`)."""
        return self.config.ema_kl_beta > 0

    def weights(self, v: torch.Tensor, target: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
        """[N] w of velocity predictions v against the target, rows at noise levels sigma [N]."""
        err = ((v.float() - target) ** 2).mean(dim=tuple(range(1, v.dim())))
        return matching_weight(err, sigma, self.config.weighting, self.config.ghuber_power)

    @torch.no_grad()
    def prepare_segment(self, stage: DiffusionStage, track: RolloutTrack) -> RolloutTrack:
        """Draw (s, eps) per sample and freeze w_old under the weights that sampled the batch."""
        track = self.with_draws(track)
        x_t, _, sigma, cond = self.inputs(track)
        v_old = stage.velocity(x_t, sigma, cond, track.segment.guidance_scale)
        w_old = self.weights(v_old, self.target(track), sigma)
        track.conditions[W_OLD_KEY] = w_old.view(len(track), self.config.draws_per_sample)
        return track

    def compute_loss_and_backward(
        self, stage: DiffusionStage, track: RolloutTrack, ctx: dict[str, Any]
    ) -> dict[str, float]:
        """ctx: `loss_scale`; `ema` (context-manager factory swapping the EMA weights in) with
        `ema_kl_beta > 0`; `reference` with `beta > 0`. Needs `prepare_segment` on `track`."""
        cfg = self.config
        self.check_prepared(track, W_OLD_KEY)
        x_t, _, sigma, cond = self.inputs(track)
        g = track.segment.guidance_scale
        others = {}
        if cfg.ema_kl_beta > 0:  # before the policy forward: the swaps change weights in place
            if ctx.get("ema") is None:
                raise ValueError(
                    "AWM with ema_kl_beta > 0 needs the EMA weights: set train.ema in the recipe"
                )
            with torch.no_grad(), ctx["ema"]():
                others["ema_kl"] = (cfg.ema_kl_beta, stage.velocity(x_t, sigma, cond, g))
        if cfg.beta > 0:
            with torch.no_grad(), ctx["reference"]():
                others["kl"] = (cfg.beta, stage.velocity(x_t, sigma, cond, g))
        v = stage.velocity(x_t, sigma, cond, g)
        w = self.weights(v, self.target(track), sigma)
        adv = track.advantages.clamp(-cfg.adv_clip, cfg.adv_clip).repeat_interleave(cfg.draws_per_sample)
        per_row_loss, ratio = awm_policy_loss(w, track.conditions[W_OLD_KEY].reshape(-1), adv, cfg.clip_range)
        policy = per_row_loss.mean()
        loss = policy
        out: dict[str, float] = {}
        for key, (coef, v_other) in others.items():
            kl = prediction_kl(v, v_other, sigma, cfg.kl_space).mean()
            loss = loss + coef * kl
            out[key] = float(kl.detach())
        (loss * ctx["loss_scale"]).backward()
        ratio = ratio.detach()
        if cfg.clip_range is not None:
            out["clipfrac"] = float(((ratio - 1).abs() > cfg.clip_range).float().mean())
        return {
            "loss": float(loss.detach()),
            "policy_loss": float(policy.detach()),
            "ratio/mean": float(ratio.mean()),
            "ratio/min": float(ratio.min()),
            "ratio/max": float(ratio.max()),
            "awm/weighted_error": float(w.detach().mean()),
            "awm/sigma_mean": float(sigma.mean()),
            **out,
        }
