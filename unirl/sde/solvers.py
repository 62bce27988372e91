"""Deterministic solvers for the ODE steps of a trajectory (the steps that are not SDE steps).

A solver integrates the probability-flow ODE `dx/dsigma = v(x, sigma)` of a
flow-matching model (x_sigma = (1 - sigma) x0 + sigma noise) over one step
sigma = sigmas[i] -> sigma' = sigmas[i+1]. It never takes an SDE step: those
are the strategy's (`unirl.sde.strategies`), with their log-probs. ODE steps
have no log-prob and are not replayed, so the solver changes the trajectory an
SDE window starts from and the final sample, never a log-prob's arithmetic.

One solver object serves one batch of trajectories from x_T to the end: the
stage calls `step` on every ODE step and `observe` on every SDE step, in
order, so a multistep solver sees the model's prediction of every step.
All arithmetic is fp32; the next sample is returned in the input dtype.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from unirl.types.sampling import ODE_SOLVERS


def _log_snr(sigma: torch.Tensor) -> torch.Tensor:
    """lambda = log(alpha / sigma) with alpha = 1 - sigma (finite for 0 < sigma < 1)."""
    return torch.log(1 - sigma) - torch.log(sigma)


class EulerSolver:
    """`x' = x + v (sigma' - sigma)`: first order, the strategies' own ODE step."""

    name: ClassVar[str] = "euler"

    def step(self, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int) -> torch.Tensor:
        """[B, ...] x_{i+1} in x's dtype."""
        dt = sigmas[i + 1].to(torch.float32) - sigmas[i].to(torch.float32)
        return (x.to(torch.float32) + v.to(torch.float32) * dt).to(x.dtype)

    def observe(self, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int) -> None:
        """A step another rule took (an SDE step); Euler keeps no history."""


class DPMSolverPP2M:
    """DPM-Solver++(2M) (Lu et al. 2022, the multistep second-order data-prediction
    solver, diffusers' `DPMSolverMultistepScheduler(algorithm_type="dpmsolver++",
    solver_order=2, solver_type="midpoint")`), as MixGRPO-Flash integrates the ODE
    steps after its SDE window.

    With alpha = 1 - sigma, lambda = log(alpha / sigma), the data prediction
    m = x - sigma v at this step (sigma_0 = sigmas[i]) and m_1 at the previous
    step (sigma_1 = sigmas[i-1]), h = lambda' - lambda_0, r = (lambda_0 - lambda_1) / h:

        x' = (sigma'/sigma_0) x + (alpha' - alpha_0 sigma'/sigma_0) (m + (m - m_1) / (2 r))

    (`alpha' (1 - e^-h)` written without the exponentials). Without a previous
    step, from sigma_1 = 1 (lambda = -inf, so the correction vanishes) and on
    the last step to sigma' = 0 it takes the first-order step, which for a
    flow-matching model is exactly Euler; diffusers does the same
    (`lower_order_final`). Second order: halving the steps divides the error
    by about 4 (tested on a Gaussian ODE with a closed-form solution).

    The previous prediction is kept across SDE steps (`observe`), as
    MixGRPO's sampler keeps its solver state through the window.
    """

    name: ClassVar[str] = "dpmpp_2m"

    def __init__(self) -> None:
        self._prev: tuple[int, torch.Tensor] | None = None  # (step index, fp32 data prediction)

    def observe(self, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int) -> None:
        """Record step i's data prediction x - sigma v (an SDE step's too)."""
        self._prev = (i, x.to(torch.float32) - sigmas[i].to(torch.float32) * v.to(torch.float32))

    def step(self, x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int) -> torch.Tensor:
        """[B, ...] x_{i+1} in x's dtype."""
        s0, s1 = sigmas[i].to(torch.float32), sigmas[i + 1].to(torch.float32)
        prev = self._prev
        self.observe(x, v, sigmas, i)
        m0 = self._prev[1]
        x32 = x.to(torch.float32)
        if prev is None or prev[0] != i - 1 or float(sigmas[i - 1]) >= 1.0 or float(s1) == 0.0:
            d = m0  # first order: x' = (s1/s0) x + (1 - s1/s0) m0 = x + v (s1 - s0)
        else:
            lam_prev, lam0, lam1 = (_log_snr(sigmas[k].to(torch.float32)) for k in (i - 1, i, i + 1))
            r = (lam0 - lam_prev) / (lam1 - lam0)
            d = m0 + (m0 - prev[1]) / (2 * r)
        ratio = s1 / s0
        return (ratio * x32 + ((1 - s1) - (1 - s0) * ratio) * d).to(x.dtype)


SOLVERS: dict[str, type] = {cls.name: cls for cls in (EulerSolver, DPMSolverPP2M)}
"""Solvers `sampling.ode_solver` can name: register one here and add its name to
`unirl.types.sampling.ODE_SOLVERS` (which validates recipes without importing this module)."""


def make_ode_solver(name: str) -> EulerSolver | DPMSolverPP2M:
    """A fresh solver (no history) for one batch of trajectories."""
    if name not in SOLVERS:
        raise ValueError(f"sampling.ode_solver must be one of {list(ODE_SOLVERS)}, got {name!r}")
    return SOLVERS[name]()
