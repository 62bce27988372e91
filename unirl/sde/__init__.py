"""Sigma schedules and SDE step strategies with log-probs (fp32)."""

from unirl.sde.schedules import dynamic_shift_mu, dynamic_shift_sigmas, sigmas_for, static_shift_sigmas
from unirl.sde.strategies import FlowSDEStrategy, StepOutput, gaussian_log_prob

__all__ = [
    "FlowSDEStrategy",
    "StepOutput",
    "dynamic_shift_mu",
    "dynamic_shift_sigmas",
    "gaussian_log_prob",
    "sigmas_for",
    "static_shift_sigmas",
]
