"""Sigma schedules against diffusers' FlowMatchEulerDiscreteScheduler and closed forms."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler
from diffusers.pipelines.stable_diffusion_3.pipeline_stable_diffusion_3 import calculate_shift

from unirl.sde import dynamic_shift_mu, dynamic_shift_sigmas, empirical_mu, sigmas_for, static_shift_sigmas
from unirl.types import DiffusionSamplingParams

TOL = 1e-6


def scheduler_sigmas(num_steps: int, **config: object) -> tuple[torch.Tensor, torch.Tensor]:
    """(sigmas [T+1], timesteps [T]) of the scheduler after `set_timesteps(T[, mu])`."""
    mu = config.pop("mu", None)
    sched = FlowMatchEulerDiscreteScheduler(**config)
    sched.set_timesteps(num_steps, mu=mu)
    return sched.sigmas, sched.timesteps


def static_ref(num_steps: int, shift: float) -> list[float]:
    """Closed form in Python floats: s = linspace(1, sigma_min, T), sigma_min = shifted 1/1000."""
    lo = shift * 1e-3 / (1 + (shift - 1) * 1e-3)
    s = [1.0 - (1.0 - lo) * k / (num_steps - 1) for k in range(num_steps)] if num_steps > 1 else [1.0]
    return [shift * x / (1 + (shift - 1) * x) for x in s] + [0.0]


def check_schedule(actual: torch.Tensor, expected: torch.Tensor | list[float]) -> None:
    expected = torch.as_tensor(expected, dtype=torch.float64)
    assert actual.dtype == torch.float32
    assert actual.shape == expected.shape
    err = (actual.double() - expected).abs().max().item()
    assert err <= TOL, f"max |ours - reference| = {err}: {actual.tolist()} vs {expected.tolist()}"
    got = actual.tolist()
    assert got[0] == 1.0 and got[-1] == 0.0
    assert all(x > y for x, y in zip(got, got[1:], strict=False)), f"not strictly decreasing: {got}"


@pytest.mark.parametrize("num_steps", [1, 2, 10, 28, 40])
@pytest.mark.parametrize("shift", [0.5, 1.0, 3.0, 5.0])
def test_static_shift_matches_diffusers(num_steps: int, shift: float) -> None:
    ours = static_shift_sigmas(num_steps, shift)
    ref, timesteps = scheduler_sigmas(num_steps, shift=shift)
    check_schedule(ours, ref)
    # the transformer's timestep is sigma * 1000: the scheduler's timesteps
    assert torch.allclose(ours[:-1] * 1000.0, timesteps, atol=1e-3, rtol=0)


@pytest.mark.parametrize("num_steps", [1, 10, 28, 40])
@pytest.mark.parametrize("mu", [0.0, 0.5, 0.8, 1.15, 2.0])
def test_dynamic_shift_matches_diffusers(num_steps: int, mu: float) -> None:
    ref, _ = scheduler_sigmas(num_steps, use_dynamic_shifting=True, mu=mu)
    check_schedule(dynamic_shift_sigmas(num_steps, mu), ref)


@pytest.mark.parametrize(("num_steps", "shift"), [(10, 3.0), (40, 3.0), (7, 5.0), (10, 1.0)])
def test_static_shift_closed_form(num_steps: int, shift: float) -> None:
    check_schedule(static_shift_sigmas(num_steps, shift), static_ref(num_steps, shift))


def test_sd3_ten_steps_end_near_zero() -> None:
    """SD3's 10 steps at shift 3 end 0.278 -> 0.0089 -> 0, not 0.25 -> 0."""
    sig = static_shift_sigmas(10, 3.0).tolist()
    assert sig[-3:] == pytest.approx([0.27805, 0.0089286, 0.0], abs=1e-5)


@pytest.mark.parametrize("shift", [0.0, -1.0])
def test_static_shift_rejects_non_positive(shift: float) -> None:
    with pytest.raises(ValueError, match=r"sampling\.shift must be > 0"):
        static_shift_sigmas(10, shift)


@pytest.mark.parametrize("seq_len", [16, 256, 1024, 2176, 4096, 9000])
def test_dynamic_shift_mu_is_diffusers_calculate_shift(seq_len: int) -> None:
    assert dynamic_shift_mu(seq_len) == calculate_shift(seq_len, 256, 4096, 0.5, 1.15)
    assert dynamic_shift_mu(seq_len, 64, 1024, 0.3, 1.2) == calculate_shift(seq_len, 64, 1024, 0.3, 1.2)


def test_dynamic_shift_mu_line() -> None:
    assert dynamic_shift_mu(256) == pytest.approx(0.5, abs=1e-12)
    assert dynamic_shift_mu(4096) == pytest.approx(1.15, abs=1e-12)
    assert dynamic_shift_mu(1024) == pytest.approx(0.5 + 0.65 * (1024 - 256) / 3840, abs=1e-12)


def test_dynamic_equals_static_with_shift_exp_mu() -> None:
    """e^mu / (e^mu + 1/t - 1) = s t / (1 + (s-1) t) with s = e^mu, on the same grid
    except the end point (the static grid ends at the shifted 1/1000)."""
    mu = 0.9
    dyn, stat = dynamic_shift_sigmas(12, mu), static_shift_sigmas(12, math.exp(mu))
    assert torch.allclose(dyn[:-2], stat[:-2], atol=1e-2, rtol=0)
    assert float(dyn[-2]) == pytest.approx(math.exp(mu) / (math.exp(mu) + 999.0), rel=1e-5)


def test_sigmas_for_static() -> None:
    p = DiffusionSamplingParams(num_steps=8, shift=3.0, dynamic_shift=False)
    out = sigmas_for(p, image_seq_len=4096)
    check_schedule(out, scheduler_sigmas(8, shift=3.0)[0])
    assert torch.equal(out, sigmas_for(p, image_seq_len=16))  # seq len ignored


def test_sigmas_for_dynamic() -> None:
    p = DiffusionSamplingParams(num_steps=8, shift=3.0, dynamic_shift=True)
    small, large = sigmas_for(p, image_seq_len=256), sigmas_for(p, image_seq_len=4096)
    check_schedule(small, scheduler_sigmas(8, use_dynamic_shifting=True, mu=0.5)[0])
    check_schedule(large, scheduler_sigmas(8, use_dynamic_shifting=True, mu=1.15)[0])
    # more tokens, more shift: every interior sigma grows
    assert all(a < b for a, b in zip(small.tolist()[1:-1], large.tolist()[1:-1], strict=True))


def test_sigmas_for_dynamic_uses_the_params_line() -> None:
    p = DiffusionSamplingParams(
        num_steps=6,
        dynamic_shift=True,
        base_seq_len=100,
        max_seq_len=300,
        base_shift=0.2,
        max_shift=1.0,
    )
    mu = calculate_shift(250, 100, 300, 0.2, 1.0)
    check_schedule(sigmas_for(p, image_seq_len=250), scheduler_sigmas(6, use_dynamic_shifting=True, mu=mu)[0])


@pytest.mark.parametrize("num_steps", [1, 10, 28])
@pytest.mark.parametrize(
    ("dynamic", "shift", "seq_len"), [(True, 3.0, 16), (True, 3.0, 1024), (False, 1.0, 0)]
)
def test_steps_grid_is_the_scheduler_given_linspace_1_over_t(
    num_steps: int, dynamic: bool, shift: float, seq_len: int
) -> None:
    """`sigma_grid: steps` pins, bit for bit, what the scheduler computes from the grid
    `linspace(1, 1/T, T)` a pipeline passes it (dynamic: with that pipeline's mu)."""
    p = DiffusionSamplingParams(num_steps=num_steps, shift=shift, dynamic_shift=dynamic, sigma_grid="steps")
    mu = calculate_shift(seq_len, 256, 4096, 0.5, 1.15) if dynamic else None
    sched = FlowMatchEulerDiscreteScheduler(shift=shift, use_dynamic_shifting=dynamic)
    sched.set_timesteps(sigmas=list(np.linspace(1.0, 1 / num_steps, num_steps)), mu=mu)
    assert torch.equal(sigmas_for(p, image_seq_len=seq_len), sched.sigmas)
    assert (
        sigmas_for(p, seq_len).tolist()
        != sigmas_for(
            DiffusionSamplingParams(num_steps=num_steps, shift=shift, dynamic_shift=dynamic), seq_len
        ).tolist()
        or num_steps == 1
    )


@pytest.mark.parametrize("num_steps", [2, 10])
def test_steps_grid_with_shift_terminal_is_the_schedulers(num_steps: int) -> None:
    """Qwen-Image's schedule: the steps grid, dynamic shift on its (256, 0.5) - (8192, 0.9) line,
    stretched to end at shift_terminal 0.02, bit-equal to the scheduler's."""
    p = DiffusionSamplingParams(
        num_steps=num_steps,
        dynamic_shift=True,
        max_seq_len=8192,
        max_shift=0.9,
        sigma_grid="steps",
        shift_terminal=0.02,
    )
    mu = calculate_shift(1024, 256, 8192, 0.5, 0.9)
    scheduler = FlowMatchEulerDiscreteScheduler(
        use_dynamic_shifting=True, shift_terminal=0.02, max_image_seq_len=8192, max_shift=0.9
    )
    scheduler.set_timesteps(sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=mu)
    ours = sigmas_for(p, image_seq_len=1024)
    assert torch.equal(ours, scheduler.sigmas) and abs(ours[-2].item() - 0.02) < 1e-6
    with pytest.raises(ValueError, match="sampling.shift_terminal=0.02 stretches the 'steps' grid"):
        DiffusionSamplingParams(sigma_grid="scheduler", shift_terminal=0.02)
    with pytest.raises(ValueError, match=r"sampling.shift_terminal must be in \(0, 1\)"):
        DiffusionSamplingParams(sigma_grid="steps", shift_terminal=1.5)


@pytest.mark.parametrize("num_steps", [1, 4, 28, 50])
@pytest.mark.parametrize("seq_len", [4, 1024, 4300, 4301, 16384])
def test_empirical_mu_is_flux2s(num_steps: int, seq_len: int) -> None:
    """FLUX.2's schedule: `Flux2Pipeline`'s own mu (`compute_empirical_mu`) and the scheduler's
    steps grid under it, bit for bit; mu reads the step count below 4300 tokens only."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu

    assert empirical_mu(seq_len, num_steps) == compute_empirical_mu(seq_len, num_steps)
    p = DiffusionSamplingParams(
        num_steps=num_steps, dynamic_shift=True, mu_rule="empirical", sigma_grid="steps"
    )
    scheduler = FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    scheduler.set_timesteps(
        sigmas=np.linspace(1.0, 1 / num_steps, num_steps), mu=compute_empirical_mu(seq_len, num_steps)
    )
    assert torch.equal(sigmas_for(p, image_seq_len=seq_len), scheduler.sigmas)
    # the hand-computed 10-step line at 1024 tokens: 8.73809524e-05 * 1024 + 1.89833333
    assert empirical_mu(1024, 10) == pytest.approx(8.73809524e-05 * 1024 + 1.89833333, abs=1e-9)
    assert (empirical_mu(seq_len, 10) == empirical_mu(seq_len, 200)) == (seq_len > 4300)


def test_empirical_mu_needs_the_dynamic_shift() -> None:
    with pytest.raises(ValueError, match=r"sampling.mu_rule='empirical' .* set dynamic_shift: true"):
        DiffusionSamplingParams(mu_rule="empirical")
