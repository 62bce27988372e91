"""fp32 sigma schedules for flow matching, equal to diffusers' flow-matching schedules.

`static_shift_sigmas` and `dynamic_shift_sigmas` reproduce
`FlowMatchEulerDiscreteScheduler.set_timesteps(T)` (and `set_timesteps(T, mu=mu)`
with `use_dynamic_shifting`), which is what `StableDiffusion3Pipeline` and
Flow-GRPO sample with; `steps_grid_sigmas` reproduces `set_timesteps(sigmas=linspace(1, 1/T, T)
[, mu=mu])`, what pipelines that pass their own grid sample with (`sampling.sigma_grid: steps`).
`tests/sde/test_schedules.py` compares them to the scheduler. They are computed here, from the sampling params alone, so the
schedule a run pins does not change with the installed diffusers: the
scheduler's default end point shifts `sigma_min` twice (diffusers issue
#13243, open in 0.42), and a fix there would move every SD3 schedule's last
steps. The result is pinned onto the `RolloutReq`; rollout and replay both
read it from there.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from unirl.types.sampling import DiffusionSamplingParams

NUM_TRAIN_TIMESTEPS = 1000
"""SD3 / SD3.5's `scheduler_config.json` value; the transformer's timestep is `sigma * 1000`."""


def _shifted(sigma: float, shift: float) -> float:
    """`shift*s / (1 + (shift-1)*s)` in fp32, as the scheduler's `__init__` computes its table."""
    s = torch.tensor([sigma], dtype=torch.float32)
    return (shift * s / (1 + (shift - 1) * s)).item()


def _base_grid(num_steps: int, sigma_max: float, sigma_min: float, num_train_timesteps: int) -> np.ndarray:
    """[T] float64 `linspace(sigma_max, sigma_min, T)` through the timestep scale, as `set_timesteps`."""
    n = num_train_timesteps
    return np.linspace(sigma_max * n, sigma_min * n, num_steps) / n


def _with_terminal_zero(sigmas: np.ndarray) -> torch.Tensor:
    sig = torch.from_numpy(sigmas).to(torch.float32)
    return torch.cat([sig, torch.zeros(1, dtype=torch.float32)])


def static_shift_sigmas(
    num_steps: int, shift: float, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS
) -> torch.Tensor:
    """[T+1] fp32 sigmas of `FlowMatchEulerDiscreteScheduler(shift=shift).set_timesteps(T)`.

    `s = linspace(1, sigma_min, T)` with the scheduler's own `sigma_min`, the
    shifted `1/num_train_timesteps`; then `sigma = shift*s / (1 + (shift-1)*s)`
    and a final 0. With T=10 and shift 3 the last step is 0.0089 -> 0.
    """
    if shift <= 0:
        raise ValueError(f"sampling.shift must be > 0, got {shift}")
    sigma_max = _shifted(1.0, shift)
    sigma_min = _shifted(1.0 / num_train_timesteps, shift)
    s = _base_grid(num_steps, sigma_max, sigma_min, num_train_timesteps)
    return _with_terminal_zero(shift * s / (1 + (shift - 1) * s))


def dynamic_shift_mu(
    seq_len: int,
    base_seq_len: int = 256,
    max_seq_len: int = 4096,
    base_shift: float = 0.5,
    max_shift: float = 1.15,
) -> float:
    """mu linear in the image token count through (base_seq_len, base_shift) and
    (max_seq_len, max_shift), in the arithmetic of diffusers' `calculate_shift`."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return seq_len * m + b


def empirical_mu(seq_len: int, num_steps: int) -> float:
    """FLUX.2's mu (`Flux2Pipeline`'s `compute_empirical_mu`): from 4300 image tokens on, the line
    `0.00016927 n + 0.45666666`; below, mu is linear in the step count T through the 10-step line
    `8.73809524e-05 n + 1.89833333` and that 200-step line, so a short schedule shifts harder."""
    a1, b1 = 8.73809524e-05, 1.89833333  # the 10-step line
    a2, b2 = 0.00016927, 0.45666666  # the 200-step line
    if seq_len > 4300:
        return float(a2 * seq_len + b2)
    m_200 = a2 * seq_len + b2
    m_10 = a1 * seq_len + b1
    slope = (m_200 - m_10) / 190.0
    return float(slope * num_steps + (m_200 - 200.0 * slope))


def dynamic_shift_sigmas(
    num_steps: int, mu: float, num_train_timesteps: int = NUM_TRAIN_TIMESTEPS
) -> torch.Tensor:
    """[T+1] fp32 sigmas of `FlowMatchEulerDiscreteScheduler(use_dynamic_shifting=True)
    .set_timesteps(T, mu=mu)`, what `StableDiffusion3Pipeline` samples with under
    dynamic shifting.

    `t = linspace(1, 1/num_train_timesteps, T)` (unshifted), then the exponential
    time shift `sigma = e^mu / (e^mu + (1/t - 1))` and a final 0.
    """
    sigma_min = (torch.tensor([1.0], dtype=torch.float32) / num_train_timesteps).item()
    t = _base_grid(num_steps, 1.0, sigma_min, num_train_timesteps)
    return _with_terminal_zero(math.exp(mu) / (math.exp(mu) + (1 / t - 1)))


def steps_grid_sigmas(
    num_steps: int, shift: float = 1.0, mu: float | None = None, shift_terminal: float | None = None
) -> torch.Tensor:
    """[T+1] fp32 sigmas of `FlowMatchEulerDiscreteScheduler.set_timesteps(sigmas=linspace(1, 1/T, T),
    mu=mu)`: the grid a pipeline passes itself (FluxPipeline, QwenImagePipeline), then the
    exponential time shift `e^mu / (e^mu + (1/t - 1))` when `mu` is given (dynamic shifting), else the
    static shift `shift*t / (1 + (shift-1)*t)`, then with `shift_terminal` the scheduler's stretch
    `1 - (1 - s) / ((1 - s[-1]) / (1 - shift_terminal))` (the last sigma becomes shift_terminal),
    and a final 0.

    The scheduler casts a given grid to fp32 numpy and shifts it there, so this does too: the
    schedule is then bit-identical to the scheduler's.
    """
    if shift <= 0:
        raise ValueError(f"sampling.shift must be > 0, got {shift}")
    t = np.linspace(1.0, 1 / num_steps, num_steps).astype(np.float32)
    if mu is None:
        shifted = shift * t / (1 + (shift - 1) * t)
    else:
        shifted = math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** 1.0)
    if shift_terminal:
        one_minus_z = 1 - shifted
        shifted = 1 - (one_minus_z / (one_minus_z[-1] / (1 - shift_terminal)))
    return _with_terminal_zero(shifted)


def schedule_tokens(sampling: DiffusionSamplingParams, model_info: dict) -> int:
    """The denoiser tokens a dynamic sigma shift counts at the sampling size: the latent cells of a
    frame (`model_info`'s `vae_scale_factor` x `patch_size` pixels a side) times its `latent_frames`
    (1 for an image family and a family that does not say; LTX-2 counts every frame, as its
    pipeline does)."""
    cell = model_info["vae_scale_factor"] * model_info["patch_size"]
    return model_info.get("latent_frames", 1) * (sampling.height // cell) * (sampling.width // cell)


def sigmas_for(sampling: DiffusionSamplingParams, image_seq_len: int) -> torch.Tensor:
    """The schedule a request pins: dynamic shift from `image_seq_len` tokens (mu by
    `sampling.mu_rule`: the linear `dynamic_shift_mu`, or FLUX.2's `empirical_mu`), or static
    shift, over the base grid `sampling.sigma_grid` names."""
    mu = None
    if sampling.dynamic_shift and sampling.mu_rule == "empirical":
        mu = empirical_mu(image_seq_len, sampling.num_steps)
    elif sampling.dynamic_shift:
        mu = dynamic_shift_mu(
            image_seq_len,
            sampling.base_seq_len,
            sampling.max_seq_len,
            sampling.base_shift,
            sampling.max_shift,
        )
    if sampling.sigma_grid == "steps":
        return steps_grid_sigmas(sampling.num_steps, sampling.shift, mu, sampling.shift_terminal)
    if mu is not None:
        return dynamic_shift_sigmas(sampling.num_steps, mu)
    return static_shift_sigmas(sampling.num_steps, sampling.shift)


# ---- training noise levels (the supervised flow-matching losses) ------------------------------
SIGMA_SAMPLING = ("logit_normal", "uniform")


def check_sigma_sampling(value: str, key: str = "sft.sigma_sampling") -> None:
    """Raise naming `key` unless `value` is one of `SIGMA_SAMPLING`."""
    if value not in SIGMA_SAMPLING:
        raise ValueError(f"{key} must be one of {SIGMA_SAMPLING}, got {value!r}")


def sample_sigmas(n: int, cfg, gen: torch.Generator) -> torch.Tensor:
    """[n] fp32 training noise levels in (0, 1) drawn from `gen` as `cfg.sigma_sampling` says
    ("logit_normal": sigmoid of N(0, 1), SD3's default; "uniform"), then shifted like the sampling
    schedule: `cfg.shift` t / (1 + (`cfg.shift` - 1) t)."""
    if cfg.sigma_sampling == "logit_normal":
        t = torch.sigmoid(torch.randn(n, generator=gen))
    else:
        t = torch.rand(n, generator=gen).clamp(1e-4, 1 - 1e-4)
    return cfg.shift * t / (1 + (cfg.shift - 1) * t)
