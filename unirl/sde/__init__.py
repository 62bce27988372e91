"""Sigma schedules, SDE step strategies with log-probs and ODE solvers (fp32)."""

from unirl.sde.schedules import (
    dynamic_shift_mu,
    dynamic_shift_sigmas,
    empirical_mu,
    sigmas_for,
    static_shift_sigmas,
    steps_grid_sigmas,
)
from unirl.sde.solvers import SOLVERS, DPMSolverPP2M, EulerSolver, make_ode_solver
from unirl.sde.strategies import (
    SDE_STRATEGIES,
    CPSStrategy,
    DanceSDEStrategy,
    FlowSDEStrategy,
    SDEStrategy,
    StepOutput,
    gaussian_log_prob,
    make_strategy,
)

__all__ = [
    "SDE_STRATEGIES",
    "SOLVERS",
    "CPSStrategy",
    "DPMSolverPP2M",
    "DanceSDEStrategy",
    "EulerSolver",
    "FlowSDEStrategy",
    "SDEStrategy",
    "StepOutput",
    "dynamic_shift_mu",
    "dynamic_shift_sigmas",
    "empirical_mu",
    "gaussian_log_prob",
    "make_ode_solver",
    "make_strategy",
    "sigmas_for",
    "static_shift_sigmas",
    "steps_grid_sigmas",
]
