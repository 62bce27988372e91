"""SDE step strategies: one denoising step with its Gaussian log-prob.

Conventions (shared by rollout and replay):
- all arithmetic in fp32; the sampled next latent is cast to the trajectory
  dtype and back before it is scored, so rollout and replay score the same
  stored tensor;
- a step's log-prob is the Gaussian log-density of the next sample averaged
  over all non-batch dims (the convention of flow_grpo and DanceGRPO);
- an ODE step (eta = 0, or a step not chosen as SDE) has no log-prob; the
  strategy's own ODE step is Euler `x + v*dt` (the stage may integrate its
  ODE steps with another solver, `unirl.sde.solvers`).

Strategies: `flow` (Flow-GRPO), `dance` (DanceGRPO: the same mean with a
constant std_dev_t = eta) and `cps` (coefficient-preserving sampling).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar

import torch

_LOG_SQRT_2PI = 0.5 * math.log(2 * math.pi)


@dataclass
class StepOutput:
    """Result of one step for a batch.

    Attributes:
        next_sample: [B, ...] x_{i+1} in the trajectory dtype.
        mean: [B, ...] fp32 step mean (SDE steps), else None.
        std_dev_t: fp32 scalar tensor, the SDE's sigma_t (SDE steps), else None.
        log_prob: [B] fp32 (SDE steps), else None.
    """

    next_sample: torch.Tensor
    mean: torch.Tensor | None = None
    std_dev_t: torch.Tensor | None = None
    log_prob: torch.Tensor | None = None


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """[B] fp32: log N(sample; mean, std^2) averaged over non-batch dims."""
    lp = -((sample - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    if lp.dim() == 1:  # mean(dim=()) would average over the batch too
        return lp
    return lp.mean(dim=tuple(range(1, lp.dim())))


class SDEStrategy(ABC):
    """One Gaussian step x' ~ N(mean(x, v), std^2) with its log-prob; a subclass gives
    `mean_and_std` (the KL terms read it too: `unirl.algorithms.kl_control`) and its registered
    `name`. Built as `cls(eta)` by `make_strategy`."""

    name: ClassVar[str]

    def __init__(self, eta: float) -> None:
        if eta < 0:
            raise ValueError(f"sampling.eta must be >= 0, got {eta}")
        self.eta = eta

    @abstractmethod
    def mean_and_std(
        self, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(mean [B, ...], std, std_dev_t) of SDE step i, all fp32 (x, v already fp32)."""

    def step(
        self,
        x: torch.Tensor,
        v: torch.Tensor,
        sigmas: torch.Tensor,
        i: int,
        *,
        sde: bool,
        noise: torch.Tensor | None = None,
        next_sample: torch.Tensor | None = None,
    ) -> StepOutput:
        """Step i from x with velocity v.

        Rollout passes `noise` ([B, ...] standard normal); replay passes the
        stored `next_sample` instead and gets its log-prob under the current v.
        With `sde=False` (or eta=0) the step is Euler and only `next_sample`
        is returned. A step whose std is 0 returns its mean and no log-prob
        (replay of one raises `noiseless_step_error`).
        """
        dtype = x.dtype
        x32, v32 = x.to(torch.float32), v.to(torch.float32)
        if not sde or self.eta == 0:
            dt = sigmas[i + 1].to(torch.float32) - sigmas[i].to(torch.float32)
            return StepOutput(next_sample=(x32 + v32 * dt).to(dtype))
        mean, std, std_dev_t = self.mean_and_std(x32, v32, sigmas, i)
        if not float(std) > 0:  # a noiseless step (CPS's last): deterministic, no density
            if next_sample is not None:
                raise ValueError(self.noiseless_step_error(sigmas, i))
            return StepOutput(next_sample=mean.to(dtype), mean=mean, std_dev_t=std_dev_t)
        if next_sample is None:
            if noise is None:
                raise ValueError("an SDE rollout step needs `noise` (or `next_sample` when replaying)")
            next_sample = (mean.detach() + std * noise.to(torch.float32)).to(dtype)
        log_prob = gaussian_log_prob(next_sample.detach().to(torch.float32), mean, std)
        return StepOutput(next_sample=next_sample, mean=mean, std_dev_t=std_dev_t, log_prob=log_prob)

    def noiseless_step_error(self, sigmas: torch.Tensor, i: int) -> str:
        """Why step i (std 0) cannot be an SDE step, and what to change."""
        return (
            f"stage.sde={self.name}: SDE step {i} (sigma {float(sigmas[i]):.4g} -> {float(sigmas[i + 1]):.4g}) "
            "has no noise, so no log-prob; keep it out of the SDE steps (sampling.sde_window / sde_steps)"
        )


class FlowSDEStrategy(SDEStrategy):
    """Flow-GRPO's reverse-time SDE for rectified-flow models.

    With sigma = sigmas[i], sigma' = sigmas[i+1], dt = sigma' - sigma < 0:
        std_dev_t = sqrt(sigma / (1 - s)) * eta, s = sigmas[1] if sigma == 1 else sigma
        mean = x*(1 + std_dev_t^2/(2 sigma)*dt) + v*(1 + std_dev_t^2*(1-sigma)/(2 sigma))*dt
        std = std_dev_t * sqrt(-dt);  x' = mean + std * eps
    """

    name: ClassVar[str] = "flow"

    def std_dev_t(self, sigmas: torch.Tensor, i: int) -> torch.Tensor:
        """fp32 scalar sigma_t of step i."""
        sigma = sigmas[i].to(torch.float32)
        s = sigmas[1].to(torch.float32) if float(sigma) == 1.0 else sigma
        return torch.sqrt(sigma / (1 - s)) * self.eta

    def mean_and_std(
        self, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sigma = sigmas[i].to(torch.float32)
        dt = sigmas[i + 1].to(torch.float32) - sigma
        std_dev_t = self.std_dev_t(sigmas, i)
        mean = (
            x * (1 + std_dev_t**2 / (2 * sigma) * dt)
            + v * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        )
        return mean, std_dev_t * torch.sqrt(-dt), std_dev_t


class DanceSDEStrategy(FlowSDEStrategy):
    """DanceGRPO's SDE: Flow-GRPO's mean with a constant std_dev_t = eta, so
    std = eta * sqrt(-dt).

    DanceGRPO writes the mean as `x + v dt - eta^2/2 * score * dt` with the
    score estimate `-(x - (1-sigma) x0) / sigma^2`, x0 = x - sigma v; expanded,
    that is Flow-GRPO's mean with std_dev_t = eta (tested).
    """

    name: ClassVar[str] = "dance"

    def std_dev_t(self, sigmas: torch.Tensor, i: int) -> torch.Tensor:
        return torch.tensor(self.eta, dtype=torch.float32, device=sigmas.device)


class CPSStrategy(SDEStrategy):
    """Coefficient-preserving sampling (CPS): the next sample keeps the schedule's
    coefficients of x0 and noise, (1 - sigma') and sigma'.

        std = sigma' * sin(eta * pi / 2)
        x0 = x - sigma v,  x1 = x + (1 - sigma) v   (predicted data and noise)
        mean = x0 (1 - sigma') + x1 sqrt(sigma'^2 - std^2)

    `std_dev_t` is the step std itself (what flow_grpo's CPS returns and its KL
    divides by). eta must be in [0, 1]; eta = 1 gives std = sigma' (DDPM-like),
    eta -> 0 the deterministic DDIM step. The last step (sigma' = 0) has no
    noise and cannot be an SDE step.
    """

    name: ClassVar[str] = "cps"

    def __init__(self, eta: float) -> None:
        super().__init__(eta)
        if eta > 1:
            raise ValueError(
                f"sampling.eta must be in [0, 1] for stage.sde=cps (std = sigma' sin(eta pi/2)), got {eta}"
            )

    def mean_and_std(
        self, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        sigma = sigmas[i].to(torch.float32)
        sigma_next = sigmas[i + 1].to(torch.float32)
        std = sigma_next * math.sin(self.eta * math.pi / 2)
        x0, x1 = x - sigma * v, x + (1 - sigma) * v
        mean = x0 * (1 - sigma_next) + x1 * torch.sqrt((sigma_next**2 - std**2).clamp_min(0))
        return mean, std, std


SDE_STRATEGIES: dict[str, type] = {cls.name: cls for cls in (FlowSDEStrategy, DanceSDEStrategy, CPSStrategy)}
"""Strategies a stage can name (`stage.sde`); register a new one here."""


def make_strategy(name: str, eta: float) -> SDEStrategy:
    """The strategy registered as `name`, with noise level `eta`."""
    if name not in SDE_STRATEGIES:
        raise ValueError(f"stage.sde must be one of {sorted(SDE_STRATEGIES)}, got {name!r}")
    return SDE_STRATEGIES[name](eta)
