"""fp32 sigma schedules for flow matching.

Computed here rather than through a diffusers scheduler call, which can apply
the shift twice (diffusers issue #13243). The result is pinned onto the
`RolloutReq`, and rollout and replay both read it from there.
"""

from __future__ import annotations

import math

import torch

from unirl.types.sampling import DiffusionSamplingParams


def static_shift_sigmas(num_steps: int, shift: float) -> torch.Tensor:
    """[T+1] fp32: t = linspace(1, 0, T+1), sigma = shift*t / (1 + (shift-1)*t)."""
    if shift <= 0:
        raise ValueError(f"sampling.shift must be > 0, got {shift}")
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    return (shift * t / (1 + (shift - 1) * t)).to(torch.float32)


def dynamic_shift_mu(
    seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """mu linear in the image token count between (base_seq_len, base_shift) and (max_seq_len, max_shift)."""
    slope = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return base_shift + slope * (seq_len - base_seq_len)


def dynamic_shift_sigmas(num_steps: int, mu: float) -> torch.Tensor:
    """[T+1] fp32: sigma = e^mu / (e^mu + (1/t - 1)), with sigma(0) = 0."""
    t = torch.linspace(1.0, 0.0, num_steps + 1, dtype=torch.float64)
    sig = torch.zeros_like(t)
    pos = t > 0
    sig[pos] = math.exp(mu) / (math.exp(mu) + (1.0 / t[pos] - 1.0))
    return sig.to(torch.float32)


def sigmas_for(sampling: DiffusionSamplingParams, image_seq_len: int) -> torch.Tensor:
    """The schedule a request pins: dynamic shift from `image_seq_len` tokens, or static shift."""
    if sampling.dynamic_shift:
        mu = dynamic_shift_mu(
            image_seq_len,
            sampling.base_seq_len,
            sampling.max_seq_len,
            sampling.base_shift,
            sampling.max_shift,
        )
        return dynamic_shift_sigmas(sampling.num_steps, mu)
    return static_shift_sigmas(sampling.num_steps, sampling.shift)
