"""ODE solvers of the non-SDE steps: Euler, and DPM-Solver++(2M) against diffusers'
DPMSolverMultistepScheduler and its order of accuracy on an ODE with a closed-form solution."""

from __future__ import annotations

import math

import pytest
import torch
from diffusers import DPMSolverMultistepScheduler

from unirl.sde import SDE_STRATEGIES, SOLVERS, make_ode_solver, make_strategy
from unirl.sde.schedules import static_shift_sigmas
from unirl.types.sampling import ODE_SOLVERS

# Data x0 ~ N(MU, S^2) per coordinate: the probability-flow ODE of x = (1 - sigma) x0 + sigma eps
# has v(x, sigma) = E[eps - x0 | x] and the exact solution x(sigma) = (1 - sigma) MU + sqrt((1 - sigma)^2 S^2 + sigma^2) x(1).
MU, S = 0.7, 0.4


def gaussian_velocity(x: torch.Tensor, sigma: float) -> torch.Tensor:
    var = (1 - sigma) ** 2 * S**2 + sigma**2
    return (sigma - (1 - sigma) * S**2) / var * (x - (1 - sigma) * MU) - MU


def exact(x1: torch.Tensor, sigma: float) -> torch.Tensor:
    return (1 - sigma) * MU + math.sqrt((1 - sigma) ** 2 * S**2 + sigma**2) * x1


def integrate(name: str, sigmas: torch.Tensor, x1: torch.Tensor) -> torch.Tensor:
    solver, x = make_ode_solver(name), x1.clone()
    for i in range(len(sigmas) - 1):
        x = solver.step(x, gaussian_velocity(x, float(sigmas[i])), sigmas, i)
    return x


@pytest.mark.parametrize(("name", "order"), [("euler", 1), ("dpmpp_2m", 2)])
def test_order_of_accuracy_on_a_gaussian_ode(name: str, order: int) -> None:
    """Halving the step divides the global error by about 2^order (measured here: Euler 1.97,
    1.98; DPM-Solver++(2M) 3.96, 4.16 from 20 -> 40 -> 80 steps on sigma in [1, 0.05])."""
    x1, end = torch.linspace(-2.0, 2.0, 9), 0.05
    errors = []
    for n in (20, 40, 80):
        sigmas = torch.linspace(1.0, end, n + 1, dtype=torch.float32)
        errors.append(float((integrate(name, sigmas, x1) - exact(x1, end)).abs().max()))
    ratios = [errors[k] / errors[k + 1] for k in range(2)]
    assert all(2**order * 0.85 < r < 2**order * 1.15 for r in ratios), (errors, ratios)
    if order == 2:  # and the more accurate one at equal steps (20 steps: 0.014 vs 0.052)
        sigmas = torch.linspace(1.0, end, 21, dtype=torch.float32)
        assert errors[0] < 0.5 * float((integrate("euler", sigmas, x1) - exact(x1, end)).abs().max())


def test_dpmpp_2m_matches_diffusers_multistep_scheduler() -> None:
    """Step by step, on diffusers' own flow sigmas (which start below 1) and a linear velocity field."""
    scheduler = DPMSolverMultistepScheduler(
        use_flow_sigmas=True,
        prediction_type="flow_prediction",
        flow_shift=3.0,
        algorithm_type="dpmsolver++",
        solver_order=2,
        solver_type="midpoint",
        lower_order_final=True,
        final_sigmas_type="zero",
    )
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas.to(torch.float32)
    assert float(sigmas[0]) < 1.0 and float(sigmas[-1]) == 0.0
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 4, 8, 8, generator=g)
    w = torch.randn(4, 4, generator=g) * 0.3

    def velocity(z: torch.Tensor, sigma: float) -> torch.Tensor:
        return torch.einsum("oc,bchw->bohw", w, z) * (1 + sigma) - 0.5

    ours, ref, solver = x.clone(), x.clone(), make_ode_solver("dpmpp_2m")
    for i, t in enumerate(scheduler.timesteps):
        ref = scheduler.step(velocity(ref, float(sigmas[i])), t, ref).prev_sample
        ours = solver.step(ours, velocity(ours, float(sigmas[i])), sigmas, i)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_first_order_cases_are_euler() -> None:
    """No history, history from sigma = 1 (lambda = -inf: the correction vanishes) and the step
    to sigma' = 0 are first-order steps, which for flow matching equal Euler."""
    sigmas = static_shift_sigmas(6, 3.0)
    assert float(sigmas[0]) == 1.0
    g = torch.Generator().manual_seed(1)
    x, v0, v1 = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(3))
    euler = make_ode_solver("euler")
    solver = make_ode_solver("dpmpp_2m")
    torch.testing.assert_close(
        solver.step(x, v0, sigmas, 0), euler.step(x, v0, sigmas, 0), rtol=1e-6, atol=1e-6
    )
    torch.testing.assert_close(
        solver.step(x, v1, sigmas, 1), euler.step(x, v1, sigmas, 1), rtol=1e-6, atol=1e-6
    )
    last = len(sigmas) - 2
    solver.observe(x, v0, sigmas, last - 1)
    torch.testing.assert_close(
        solver.step(x, v1, sigmas, last), euler.step(x, v1, sigmas, last), rtol=1e-6, atol=1e-6
    )


def test_second_order_step_against_the_formula_and_history_through_an_sde_step() -> None:
    """After `observe` (an SDE step at i-1) the next ODE step uses that step's data prediction:
    x' = (s'/s) x + (alpha' - alpha s'/s)(m + (m - m_prev)/(2r)), r = (lam - lam_prev)/(lam' - lam),
    written here in float64 with diffusers' exponential form alpha' (1 - e^-h)."""
    sigmas = static_shift_sigmas(8, 3.0)
    g = torch.Generator().manual_seed(2)
    x_prev, v_prev, x, v = (torch.randn(2, 3, 4, 4, generator=g) for _ in range(4))
    i = 4
    solver = make_ode_solver("dpmpp_2m")
    solver.observe(x_prev, v_prev, sigmas, i - 1)
    out = solver.step(x, v, sigmas, i)
    s_prev, s0, s1 = (float(sigmas[k]) for k in (i - 1, i, i + 1))
    lam = [math.log((1 - s) / s) for s in (s_prev, s0, s1)]
    h, h0 = lam[2] - lam[1], lam[1] - lam[0]
    m0 = x.double() - s0 * v.double()
    m1 = x_prev.double() - s_prev * v_prev.double()
    d1 = (m0 - m1) / (h0 / h)
    expected = (s1 / s0) * x.double() + (1 - s1) * (1 - math.exp(-h)) * (m0 + 0.5 * d1)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)
    # a step whose predecessor was not seen (a fresh solver) is first order instead
    fresh = make_ode_solver("dpmpp_2m").step(x, v, sigmas, i)
    assert not torch.allclose(fresh, out)


@pytest.mark.parametrize("strategy", sorted(SDE_STRATEGIES))
def test_euler_solver_equals_the_strategies_ode_step(strategy: str) -> None:
    """The stage's default ODE path is bit-identical to the strategies' non-SDE step."""
    sigmas = static_shift_sigmas(10, 3.0)
    g = torch.Generator().manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x, v = (torch.randn(2, 3, 4, 4, generator=g).to(dtype) for _ in range(2))
        for i in (0, 5, 9):
            a = make_ode_solver("euler").step(x, v, sigmas, i)
            b = make_strategy(strategy, 0.7).step(x, v, sigmas, i, sde=False).next_sample
            assert a.dtype == dtype and torch.equal(a, b)


def test_registry_and_unknown_name() -> None:
    assert tuple(SOLVERS) == ODE_SOLVERS
    with pytest.raises(
        ValueError, match=r"sampling\.ode_solver must be one of \['euler', 'dpmpp_2m'\], got 'heun'"
    ):
        make_ode_solver("heun")
