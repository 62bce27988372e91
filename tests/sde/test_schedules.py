"""Sigma schedules against closed forms computed here with Python floats."""

from __future__ import annotations

import math

import pytest
import torch

from unirl.sde import dynamic_shift_mu, dynamic_shift_sigmas, sigmas_for, static_shift_sigmas
from unirl.types import DiffusionSamplingParams


def ts(num_steps: int) -> list[float]:
    """linspace(1, 0, T+1) in Python floats."""
    return [1.0 - k / num_steps for k in range(num_steps + 1)]


def static_ref(num_steps: int, shift: float) -> list[float]:
    return [shift * t / (1 + (shift - 1) * t) for t in ts(num_steps)]


def dynamic_ref(num_steps: int, mu: float) -> list[float]:
    return [0.0 if t == 0 else math.exp(mu) / (math.exp(mu) + (1 / t - 1)) for t in ts(num_steps)]


def check(actual: torch.Tensor, expected: list[float]) -> None:
    assert actual.dtype == torch.float32
    assert actual.shape == (len(expected),)
    got = actual.tolist()
    for k, (a, e) in enumerate(zip(got, expected, strict=True)):
        assert abs(a - e) <= 1e-7, f"sigma[{k}] = {a}, closed form {e}"
    assert got[0] == 1.0 and got[-1] == 0.0
    assert all(x > y for x, y in zip(got, got[1:], strict=False)), f"not strictly decreasing: {got}"


@pytest.mark.parametrize(
    ("num_steps", "shift"), [(10, 3.0), (40, 3.0), (1, 3.0), (7, 5.0), (10, 1.0), (10, 0.5)]
)
def test_static_shift_closed_form(num_steps: int, shift: float) -> None:
    check(static_shift_sigmas(num_steps, shift), static_ref(num_steps, shift))


def test_static_shift_concrete_values() -> None:
    sig = static_shift_sigmas(4, 3.0).tolist()
    # t = 0.5: 1.5 / 2 = 0.75; t = 0.25: 0.75 / 1.5 = 0.5; t = 0.75: 2.25 / 2.5 = 0.9
    assert sig == pytest.approx([1.0, 0.9, 0.75, 0.5, 0.0], abs=1e-7)


def test_shift_one_is_linspace() -> None:
    assert torch.allclose(static_shift_sigmas(10, 1.0), torch.linspace(1, 0, 11), atol=1e-7, rtol=0)


@pytest.mark.parametrize("shift", [0.0, -1.0])
def test_static_shift_rejects_non_positive(shift: float) -> None:
    with pytest.raises(ValueError, match=r"sampling\.shift must be > 0"):
        static_shift_sigmas(10, shift)


def test_dynamic_shift_mu_line() -> None:
    assert dynamic_shift_mu(256) == pytest.approx(0.5, abs=1e-12)
    assert dynamic_shift_mu(4096) == pytest.approx(1.15, abs=1e-12)
    assert dynamic_shift_mu((256 + 4096) // 2) == pytest.approx((0.5 + 1.15) / 2, abs=1e-12)
    # linear: mu(1024) by hand
    assert dynamic_shift_mu(1024) == pytest.approx(0.5 + 0.65 * (1024 - 256) / 3840, abs=1e-12)
    # custom line
    assert dynamic_shift_mu(
        10, base_seq_len=0, max_seq_len=100, base_shift=1.0, max_shift=2.0
    ) == pytest.approx(1.1)


@pytest.mark.parametrize(("num_steps", "mu"), [(10, 0.5), (28, 1.15), (10, 0.0), (5, 2.0), (1, 0.8)])
def test_dynamic_shift_closed_form(num_steps: int, mu: float) -> None:
    check(dynamic_shift_sigmas(num_steps, mu), dynamic_ref(num_steps, mu))


def test_dynamic_equals_static_with_shift_exp_mu() -> None:
    """e^mu / (e^mu + 1/t - 1) = s t / (1 + (s-1) t) with s = e^mu: the two forms agree."""
    mu = 0.9
    assert torch.allclose(
        dynamic_shift_sigmas(12, mu), static_shift_sigmas(12, math.exp(mu)), atol=1e-6, rtol=0
    )


def test_sigmas_for_static() -> None:
    p = DiffusionSamplingParams(num_steps=8, shift=3.0, dynamic_shift=False)
    out = sigmas_for(p, image_seq_len=4096)
    check(out, static_ref(8, 3.0))
    assert torch.equal(out, sigmas_for(p, image_seq_len=16))  # seq len ignored


def test_sigmas_for_dynamic() -> None:
    p = DiffusionSamplingParams(num_steps=8, shift=3.0, dynamic_shift=True)
    small, large = sigmas_for(p, image_seq_len=256), sigmas_for(p, image_seq_len=4096)
    check(small, dynamic_ref(8, 0.5))
    check(large, dynamic_ref(8, 1.15))
    assert not torch.allclose(small, static_shift_sigmas(8, 3.0))
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
    mu = 0.2 + (1.0 - 0.2) * (250 - 100) / (300 - 100)
    check(sigmas_for(p, image_seq_len=250), dynamic_ref(6, mu))
