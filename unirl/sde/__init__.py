"""Sigma schedules and SDE step strategies with log-probs (fp32)."""

from unirl.sde.schedules import dynamic_shift_mu, dynamic_shift_sigmas, sigmas_for, static_shift_sigmas
from unirl.sde.strategies import (
    SDE_STRATEGIES,
    FlowSDEStrategy,
    SDEStrategy,
    StepOutput,
    gaussian_log_prob,
    make_strategy,
)

__all__ = [
    "SDE_STRATEGIES",
    "FlowSDEStrategy",
    "SDEStrategy",
    "StepOutput",
    "dynamic_shift_mu",
    "dynamic_shift_sigmas",
    "gaussian_log_prob",
    "make_strategy",
    "sigmas_for",
    "static_shift_sigmas",
]
