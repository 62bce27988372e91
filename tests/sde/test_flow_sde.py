"""FlowSDEStrategy.step against an independent float64 closed form (Flow-GRPO's SDE)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from unirl.sde import FlowSDEStrategy, gaussian_log_prob

T = 10
SHIFT = 3.0
SHAPE = (3, 4, 8, 8)  # [B, C, H, W]


def schedule() -> torch.Tensor:
    """fp32 static-shift schedule, computed here (not through unirl.sde.schedules)."""
    t = [1.0 - k / T for k in range(T + 1)]
    return torch.tensor([SHIFT * x / (1 + (SHIFT - 1) * x) for x in t], dtype=torch.float32)


def reference(
    x: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, i: int, eta: float
) -> tuple[torch.Tensor, float, float]:
    """(mean [float64], std, std_dev_t) of step i, written from the Flow-GRPO formulas."""
    sig = [float(s) for s in sigmas]  # the exact fp32 values, as Python floats
    sigma, sigma_next = sig[i], sig[i + 1]
    dt = sigma_next - sigma
    s = sig[1] if sigma == 1.0 else sigma
    std_dev_t = math.sqrt(sigma / (1 - s)) * eta
    x64, v64 = x.to(torch.float64), v.to(torch.float64)
    mean = (
        x64 * (1 + std_dev_t**2 / (2 * sigma) * dt)
        + v64 * (1 + std_dev_t**2 * (1 - sigma) / (2 * sigma)) * dt
    )
    return mean, std_dev_t * math.sqrt(-dt), std_dev_t


def ref_log_prob(sample: torch.Tensor, mean: torch.Tensor, std: float) -> torch.Tensor:
    lp = Normal(mean, torch.full_like(mean, std)).log_prob(sample.to(torch.float64))
    return lp.mean(dim=tuple(range(1, lp.dim())))


def inputs(
    seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g).to(dtype)
    v = torch.randn(SHAPE, generator=g).to(dtype)
    noise = torch.randn(SHAPE, generator=g)
    return x, v, noise


@pytest.mark.parametrize("i", [0, 4, T - 1])
@pytest.mark.parametrize("eta", [0.7, 1.0])
def test_step_matches_closed_form(i: int, eta: float) -> None:
    sigmas = schedule()
    x, v, noise = inputs(i)
    out = FlowSDEStrategy(eta).step(x, v, sigmas, i, sde=True, noise=noise)
    mean, std, std_dev_t = reference(x, v, sigmas, i, eta)

    assert out.std_dev_t is not None and out.mean is not None and out.log_prob is not None
    assert out.mean.dtype == out.log_prob.dtype == out.std_dev_t.dtype == torch.float32
    assert out.next_sample.dtype == torch.float32 and out.next_sample.shape == SHAPE
    assert out.log_prob.shape == (SHAPE[0],)
    assert math.isfinite(std_dev_t)
    assert float(out.std_dev_t) == pytest.approx(std_dev_t, rel=1e-6)
    torch.testing.assert_close(out.mean.double(), mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.next_sample.double(), mean + std * noise.double(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(
        out.log_prob.double(), ref_log_prob(out.next_sample, mean, std), rtol=1e-6, atol=1e-5
    )
    # a rollout sample is drawn from N(mean, std^2): its log-prob is about -log(std) - log(sqrt(2 pi)) - 1/2
    expected = -math.log(std) - 0.5 * math.log(2 * math.pi) - 0.5
    assert out.log_prob.double().sub(expected).abs().max() < 0.15


def test_sigma_one_guard_uses_second_sigma() -> None:
    """At sigma = 1, sqrt(sigma / (1 - sigma)) is infinite; Flow-GRPO uses sigmas[1] instead."""
    sigmas = schedule()
    assert float(sigmas[0]) == 1.0
    strategy = FlowSDEStrategy(0.7)
    s1 = float(sigmas[1])
    assert float(strategy.std_dev_t(sigmas, 0)) == pytest.approx(math.sqrt(1.0 / (1 - s1)) * 0.7, rel=1e-6)
    # interior steps use their own sigma
    s4 = float(sigmas[4])
    assert float(strategy.std_dev_t(sigmas, 4)) == pytest.approx(math.sqrt(s4 / (1 - s4)) * 0.7, rel=1e-6)
    x, v, noise = inputs()
    out = strategy.step(x, v, sigmas, 0, sde=True, noise=noise)
    assert out.log_prob is not None and torch.isfinite(out.log_prob).all()
    assert torch.isfinite(out.next_sample).all()


@pytest.mark.parametrize("i", [0, 5])
def test_rollout_then_replay_give_identical_log_prob(i: int) -> None:
    sigmas = schedule()
    x, v, noise = inputs(3)
    strategy = FlowSDEStrategy(0.7)
    rollout = strategy.step(x, v, sigmas, i, sde=True, noise=noise)
    replay = strategy.step(x, v, sigmas, i, sde=True, next_sample=rollout.next_sample)
    assert replay.log_prob is not None and rollout.log_prob is not None
    assert torch.equal(replay.log_prob, rollout.log_prob)
    assert torch.equal(replay.next_sample, rollout.next_sample)
    # a different velocity (the policy moved) changes the replayed log-prob
    moved = strategy.step(x, v + 0.1, sigmas, i, sde=True, next_sample=rollout.next_sample)
    assert moved.log_prob is not None and not torch.allclose(moved.log_prob, rollout.log_prob)


def test_replay_log_prob_gradient_wrt_velocity() -> None:
    """d logp / d v = (prev - mean) / std^2 * dmean/dv / N with dmean/dv = (1 + sdt^2 (1-sigma)/(2 sigma)) dt."""
    sigmas = schedule()
    i, eta = 3, 0.7
    x, v, noise = inputs(5)
    strategy = FlowSDEStrategy(eta)
    prev = strategy.step(x, v, sigmas, i, sde=True, noise=noise).next_sample
    v_req = v.clone().requires_grad_(True)
    out = strategy.step(x, v_req, sigmas, i, sde=True, next_sample=prev)
    assert out.log_prob is not None
    out.log_prob.sum().backward()
    mean, std, sdt = reference(x, v, sigmas, i, eta)
    sigma, dt = float(sigmas[i]), float(sigmas[i + 1]) - float(sigmas[i])
    n = math.prod(SHAPE[1:])
    grad = (prev.double() - mean) / std**2 * (1 + sdt**2 * (1 - sigma) / (2 * sigma)) * dt / n
    assert v_req.grad is not None
    torch.testing.assert_close(v_req.grad.double(), grad, rtol=1e-4, atol=1e-7)


def test_bf16_next_sample_is_scored_after_round_trip() -> None:
    sigmas = schedule()
    i, eta = 6, 0.3
    x, v, noise = inputs(7, torch.bfloat16)
    x = (x * 4).to(torch.bfloat16)  # large values: bf16 rounding error is large relative to std
    out = FlowSDEStrategy(eta).step(x, v, sigmas, i, sde=True, noise=noise)
    assert out.next_sample.dtype == torch.bfloat16
    assert out.log_prob is not None and out.log_prob.dtype == torch.float32
    mean, std, _ = reference(x, v, sigmas, i, eta)
    unrounded = mean + std * noise.double()
    # the stored sample is the bf16 rounding of mean + std * noise
    torch.testing.assert_close(out.next_sample.double(), unrounded, rtol=2**-8, atol=1e-6)
    at_stored = ref_log_prob(out.next_sample, mean, std)
    at_unrounded = ref_log_prob(unrounded, mean, std)
    torch.testing.assert_close(out.log_prob.double(), at_stored, rtol=1e-6, atol=1e-5)
    # and the check is sharp: scoring the unrounded sample would be visibly different
    assert (at_unrounded - at_stored).abs().max() > 1e-3
    # replay from the stored bf16 tensor scores the same thing
    replay = FlowSDEStrategy(eta).step(x, v, sigmas, i, sde=True, next_sample=out.next_sample)
    assert replay.log_prob is not None and torch.equal(replay.log_prob, out.log_prob)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("eta", "sde"), [(0.0, True), (0.7, False), (0.0, False)])
def test_ode_step_is_euler(eta: float, sde: bool, dtype: torch.dtype) -> None:
    sigmas = schedule()
    i = 2
    x, v, noise = inputs(9, dtype)
    out = FlowSDEStrategy(eta).step(x, v, sigmas, i, sde=sde, noise=noise)
    assert out.log_prob is None and out.mean is None and out.std_dev_t is None
    assert out.next_sample.dtype == dtype
    dt = float(sigmas[i + 1]) - float(sigmas[i])
    euler = x.double() + v.double() * dt
    if dtype == torch.float32:
        torch.testing.assert_close(out.next_sample.double(), euler, rtol=1e-6, atol=1e-6)
    else:  # computed in fp32, then rounded once to bf16
        assert torch.equal(out.next_sample, (x.float() + v.float() * torch.tensor(dt).float()).bfloat16())
    # the noise is ignored: a different draw gives the same step
    again = FlowSDEStrategy(eta).step(x, v, sigmas, i, sde=sde, noise=torch.randn(SHAPE))
    assert torch.equal(again.next_sample, out.next_sample)


def test_eta_zero_limit_of_sde_mean_is_euler() -> None:
    """As eta -> 0 the SDE mean tends to the Euler step."""
    sigmas = schedule()
    x, v, _ = inputs(11)
    mean, _, _ = reference(x, v, sigmas, 4, 1e-4)
    dt = float(sigmas[5]) - float(sigmas[4])
    torch.testing.assert_close(mean, x.double() + v.double() * dt, rtol=0, atol=1e-6)


def test_sde_step_needs_noise_or_next_sample() -> None:
    x, v, _ = inputs()
    with pytest.raises(ValueError, match="needs `noise`"):
        FlowSDEStrategy(0.7).step(x, v, schedule(), 1, sde=True)


def test_negative_eta_rejected() -> None:
    with pytest.raises(ValueError, match=r"sampling\.eta must be >= 0"):
        FlowSDEStrategy(-0.1)


@pytest.mark.parametrize(
    "shape",
    [(4, 7), (2, 3, 5, 5), (5,)],
)
@pytest.mark.parametrize("per_element_std", [False, True])
def test_gaussian_log_prob_matches_normal(shape: tuple[int, ...], per_element_std: bool) -> None:
    g = torch.Generator().manual_seed(1)
    sample = torch.randn(shape, generator=g, dtype=torch.float64)
    mean = torch.randn(shape, generator=g, dtype=torch.float64)
    std = torch.rand(shape, generator=g, dtype=torch.float64) + 0.1 if per_element_std else torch.tensor(0.37)
    std = std.to(torch.float64)
    out = gaussian_log_prob(sample, mean, std)
    lp = Normal(mean, std.expand(shape)).log_prob(sample)
    expected = lp.mean(dim=tuple(range(1, lp.dim()))) if lp.dim() > 1 else lp
    assert out.shape == (shape[0],)
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


def test_gaussian_log_prob_concrete_value() -> None:
    # sample = mean: log N = -log(std) - log(sqrt(2 pi)); one std away: minus 1/2 more
    out = gaussian_log_prob(torch.tensor([[0.0, 2.0]]), torch.zeros(1, 2), torch.tensor(2.0))
    expected = -math.log(2.0) - 0.5 * math.log(2 * math.pi) - 0.25
    assert out.item() == pytest.approx(expected, rel=1e-6)
