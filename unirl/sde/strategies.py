"""SDE step strategies: one denoising step with its Gaussian log-prob.

Conventions (shared by rollout and replay):
- all arithmetic in fp32; the sampled next latent is cast to the trajectory
  dtype and back before it is scored, so rollout and replay score the same
  stored tensor;
- a step's log-prob is the Gaussian log-density of the next sample averaged
  over all non-batch dims (the convention of flow_grpo and DanceGRPO);
- an ODE step (eta = 0, or a step not chosen as SDE) is a plain Euler step
  `x + v*dt` and has no log-prob.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

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


class SDEStrategy(Protocol):
    """One denoising step with its log-prob; built as `cls(eta)` by `make_strategy`."""

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
    ) -> StepOutput: ...


def gaussian_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """[B] fp32: log N(sample; mean, std^2) averaged over non-batch dims."""
    lp = -((sample - mean) ** 2) / (2 * std**2) - torch.log(std) - _LOG_SQRT_2PI
    if lp.dim() == 1:  # mean(dim=()) would average over the batch too
        return lp
    return lp.mean(dim=tuple(range(1, lp.dim())))


class FlowSDEStrategy:
    """Flow-GRPO's reverse-time SDE for rectified-flow models.

    With sigma = sigmas[i], sigma' = sigmas[i+1], dt = sigma' - sigma < 0:
        std_dev_t = sqrt(sigma / (1 - s)) * eta, s = sigmas[1] if sigma == 1 else sigma
        mean = x*(1 + std_dev_t^2/(2 sigma)*dt) + v*(1 + std_dev_t^2*(1-sigma)/(2 sigma))*dt
        std = std_dev_t * sqrt(-dt);  x' = mean + std * eps
    """

    def __init__(self, eta: float) -> None:
        if eta < 0:
            raise ValueError(f"sampling.eta must be >= 0, got {eta}")
        self.eta = eta

    def std_dev_t(self, sigmas: torch.Tensor, i: int) -> torch.Tensor:
        """fp32 scalar sigma_t of step i."""
        sigma = sigmas[i].to(torch.float32)
        s = sigmas[1].to(torch.float32) if float(sigma) == 1.0 else sigma
        return torch.sqrt(sigma / (1 - s)) * self.eta

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
        is returned.
        """
        dtype = x.dtype
        sigma = sigmas[i].to(torch.float32)
        dt = sigmas[i + 1].to(torch.float32) - sigma
        x32, v32 = x.to(torch.float32), v.to(torch.float32)
        if not sde or self.eta == 0:
            return StepOutput(next_sample=(x32 + v32 * dt).to(dtype))
        std_dev_t = self.std_dev_t(sigmas, i)
        mean = (
            x32 * (1 + std_dev_t**2 / (2 * sigma) * dt)
            + v32 * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
        )
        std = std_dev_t * torch.sqrt(-dt)
        if next_sample is None:
            if noise is None:
                raise ValueError("an SDE rollout step needs `noise` (or `next_sample` when replaying)")
            next_sample = (mean.detach() + std * noise.to(torch.float32)).to(dtype)
        log_prob = gaussian_log_prob(next_sample.detach().to(torch.float32), mean, std)
        return StepOutput(next_sample=next_sample, mean=mean, std_dev_t=std_dev_t, log_prob=log_prob)


SDE_STRATEGIES: dict[str, type] = {"flow": FlowSDEStrategy}
"""Strategies a stage can name (`stage.sde`); register a new one here."""


def make_strategy(name: str, eta: float) -> SDEStrategy:
    """The strategy registered as `name`, with noise level `eta`."""
    if name not in SDE_STRATEGIES:
        raise ValueError(f"stage.sde must be one of {sorted(SDE_STRATEGIES)}, got {name!r}")
    return SDE_STRATEGIES[name](eta)
