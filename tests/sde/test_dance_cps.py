"""DanceSDEStrategy and CPSStrategy against independent float64 closed forms (DanceGRPO's
score form of the mean, the CPS paper's coefficients) and torch.distributions.Normal."""

from __future__ import annotations

import math

import pytest
import torch
from torch.distributions import Normal

from unirl.sde import SDE_STRATEGIES, CPSStrategy, DanceSDEStrategy, FlowSDEStrategy, make_strategy

T = 10
SHIFT = 3.0
SHAPE = (3, 4, 8, 8)  # [B, C, H, W]


def schedule() -> torch.Tensor:
    """fp32 static-shift schedule ending at 0, computed here (not through unirl.sde.schedules)."""
    t = [1.0 - k / T for k in range(T + 1)]
    return torch.tensor([SHIFT * x / (1 + (SHIFT - 1) * x) for x in t], dtype=torch.float32)


def inputs(seed: int = 0, dtype: torch.dtype = torch.float32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(SHAPE, generator=g).to(dtype)
    v = torch.randn(SHAPE, generator=g).to(dtype)
    noise = torch.randn(SHAPE, generator=g)
    return x, v, noise


def dance_reference(x, v, sigmas, i, eta):
    """DanceGRPO's `flux_step` in float64: mean = x + v dt - eta^2/2 * score * dt with the
    score estimate -(x - (1 - sigma) x0) / sigma^2, x0 = x - sigma v; std = eta sqrt(-dt)."""
    sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
    dt = sigma_next - sigma
    x64, v64 = x.double(), v.double()
    x0 = x64 - sigma * v64
    score = -(x64 - x0 * (1 - sigma)) / sigma**2
    mean = x64 + dt * v64 - 0.5 * eta**2 * score * dt
    return mean, eta * math.sqrt(-dt)


def cps_reference(x, v, sigmas, i, eta):
    """CPS in float64: std = sigma' sin(eta pi/2), mean = x0 (1 - sigma') + x1 sqrt(sigma'^2 - std^2)."""
    sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
    std = sigma_next * math.sin(eta * math.pi / 2)
    x64, v64 = x.double(), v.double()
    x0, x1 = x64 - sigma * v64, x64 + (1 - sigma) * v64
    return x0 * (1 - sigma_next) + x1 * math.sqrt(sigma_next**2 - std**2), std


def normal_log_prob(sample, mean, std: float) -> torch.Tensor:
    lp = Normal(mean, torch.full_like(mean, std)).log_prob(sample.double())
    return lp.mean(dim=tuple(range(1, lp.dim())))


CASES = [
    ("dance", dance_reference, 0.3, [0, 4, T - 1]),
    ("dance", dance_reference, 1.0, [2]),
    ("cps", cps_reference, 0.7, [0, 4, T - 2]),  # T-1 ends at sigma' = 0: no noise (tested below)
    ("cps", cps_reference, 1.0, [5]),
]


@pytest.mark.parametrize(("name", "reference", "eta", "steps"), CASES)
def test_step_matches_closed_form(name, reference, eta, steps) -> None:
    sigmas = schedule()
    strategy = make_strategy(name, eta)
    for i in steps:
        x, v, noise = inputs(i)
        out = strategy.step(x, v, sigmas, i, sde=True, noise=noise)
        mean, std = reference(x, v, sigmas, i, eta)
        assert out.mean is not None and out.log_prob is not None and out.std_dev_t is not None
        assert out.mean.dtype == out.log_prob.dtype == torch.float32 and out.log_prob.shape == (SHAPE[0],)
        torch.testing.assert_close(out.mean.double(), mean, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(
            out.next_sample.double(), mean + std * noise.double(), rtol=1e-5, atol=1e-5
        )
        torch.testing.assert_close(
            out.log_prob.double(), normal_log_prob(out.next_sample, mean, std), rtol=1e-5, atol=1e-4
        )
        # std_dev_t: DanceGRPO's constant eta; CPS's step std itself (what flow_grpo's KL divides by)
        assert float(out.std_dev_t) == pytest.approx(eta if name == "dance" else std, rel=1e-6)


def test_dance_is_flow_with_constant_std_dev_t() -> None:
    """The two SDEs share the mean formula; Dance replaces sqrt(sigma/(1-sigma)) * eta by eta."""
    sigmas = schedule()
    x, v, noise = inputs(1)
    for i in (1, 5):
        flow, dance = FlowSDEStrategy(0.7), DanceSDEStrategy(0.7)
        sigma = float(sigmas[i])
        # a Flow eta that makes Flow's std_dev_t equal 0.7 gives Dance's step exactly
        flow.eta = 0.7 / math.sqrt(sigma / (1 - sigma))
        a = flow.step(x, v, sigmas, i, sde=True, noise=noise)
        b = dance.step(x, v, sigmas, i, sde=True, noise=noise)
        torch.testing.assert_close(a.mean, b.mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(a.log_prob, b.log_prob, rtol=1e-5, atol=1e-5)


def test_cps_preserves_the_coefficients_of_data_and_noise() -> None:
    """With the exact velocity v = eps - x0 of x = (1 - sigma) x0 + sigma eps, the CPS step is
    (1 - sigma') x0 + sqrt(sigma'^2 - std^2) eps + std z: data coefficient 1 - sigma' and total
    noise variance sigma'^2, the marginal of the schedule at sigma'."""
    sigmas = schedule()
    g = torch.Generator().manual_seed(3)
    x0, eps = torch.randn(SHAPE, generator=g), torch.randn(SHAPE, generator=g)
    for i in (0, 3, 7):
        sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
        x, v = (1 - sigma) * x0 + sigma * eps, eps - x0
        out = CPSStrategy(0.6).step(x, v, sigmas, i, sde=True, noise=torch.zeros(SHAPE))
        std = sigma_next * math.sin(0.6 * math.pi / 2)
        expected = (1 - sigma_next) * x0 + math.sqrt(sigma_next**2 - std**2) * eps
        torch.testing.assert_close(out.mean, expected, rtol=1e-5, atol=1e-5)
        assert (math.sqrt(sigma_next**2 - std**2)) ** 2 + std**2 == pytest.approx(sigma_next**2)


@pytest.mark.parametrize("name", sorted(SDE_STRATEGIES))
def test_rollout_then_replay_give_identical_log_prob(name: str) -> None:
    sigmas = schedule()
    x, v, noise = inputs(4)
    strategy = make_strategy(name, 0.5)
    rollout = strategy.step(x, v, sigmas, 3, sde=True, noise=noise)
    replay = strategy.step(x, v, sigmas, 3, sde=True, next_sample=rollout.next_sample)
    assert torch.equal(replay.log_prob, rollout.log_prob)
    moved = strategy.step(x, v + 0.1, sigmas, 3, sde=True, next_sample=rollout.next_sample)
    assert not torch.allclose(moved.log_prob, rollout.log_prob)


@pytest.mark.parametrize("name", ["dance", "cps"])
def test_bf16_next_sample_is_scored_after_round_trip(name: str) -> None:
    sigmas = schedule()
    x, v, noise = inputs(7, torch.bfloat16)
    x = (x * 4).to(torch.bfloat16)
    strategy = make_strategy(name, 0.3)
    out = strategy.step(x, v, sigmas, 6, sde=True, noise=noise)
    assert out.next_sample.dtype == torch.bfloat16 and out.log_prob.dtype == torch.float32
    reference = dance_reference if name == "dance" else cps_reference
    mean, std = reference(x, v, sigmas, 6, 0.3)
    torch.testing.assert_close(
        out.log_prob.double(), normal_log_prob(out.next_sample, mean, std), rtol=1e-5, atol=1e-4
    )


def test_cps_log_prob_gradient_wrt_velocity() -> None:
    """d logp / d v = (prev - mean) / std^2 * dmean/dv / N, dmean/dv = -sigma (1 - sigma') + (1 - sigma) sqrt(sigma'^2 - std^2)."""
    sigmas = schedule()
    i, eta = 4, 0.7
    x, v, noise = inputs(5)
    strategy = CPSStrategy(eta)
    prev = strategy.step(x, v, sigmas, i, sde=True, noise=noise).next_sample
    v_req = v.clone().requires_grad_(True)
    strategy.step(x, v_req, sigmas, i, sde=True, next_sample=prev).log_prob.sum().backward()
    mean, std = cps_reference(x, v, sigmas, i, eta)
    sigma, sigma_next = float(sigmas[i]), float(sigmas[i + 1])
    dmean_dv = -sigma * (1 - sigma_next) + (1 - sigma) * math.sqrt(sigma_next**2 - std**2)
    grad = (prev.double() - mean) / std**2 * dmean_dv / math.prod(SHAPE[1:])
    torch.testing.assert_close(v_req.grad.double(), grad, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("name", ["dance", "cps"])
def test_eta_zero_and_ode_steps_are_euler(name: str) -> None:
    sigmas = schedule()
    x, v, noise = inputs(2)
    euler = x + v * (sigmas[5] - sigmas[4])
    for out in (
        make_strategy(name, 0.0).step(x, v, sigmas, 4, sde=True, noise=noise),
        make_strategy(name, 0.5).step(x, v, sigmas, 4, sde=False),
    ):
        assert out.log_prob is None and out.mean is None
        assert torch.equal(out.next_sample, euler)
    # CPS's eta -> 0 limit is the same Euler step (DDIM for flow matching)
    near = CPSStrategy(1e-6).step(x, v, sigmas, 4, sde=True, noise=noise)
    torch.testing.assert_close(near.mean, euler, rtol=1e-5, atol=1e-5)


def test_cps_last_step_has_no_noise_and_no_log_prob() -> None:
    """sigma' = 0: CPS's std is 0, the step is its mean (the predicted x0) with no density;
    replaying it as an SDE step is refused with the fix."""
    sigmas = schedule()
    x, v, noise = inputs()
    assert float(sigmas[T]) == 0.0
    out = CPSStrategy(0.7).step(x, v, sigmas, T - 1, sde=True, noise=noise)
    assert out.log_prob is None
    torch.testing.assert_close(out.next_sample, x - float(sigmas[T - 1]) * v)
    with pytest.raises(ValueError, match=r"stage\.sde=cps: SDE step 9 .* has no noise, so no log-prob"):
        CPSStrategy(0.7).step(x, v, sigmas, T - 1, sde=True, next_sample=out.next_sample)
    # Flow's and Dance's last step keep noise (sqrt(-dt) > 0)
    for name in ("flow", "dance"):
        assert make_strategy(name, 0.7).step(x, v, sigmas, T - 1, sde=True, noise=noise).log_prob is not None


def test_bad_eta_and_unknown_name() -> None:
    with pytest.raises(ValueError, match=r"sampling\.eta must be in \[0, 1\] for stage\.sde=cps"):
        CPSStrategy(1.5)
    with pytest.raises(ValueError, match=r"sampling\.eta must be >= 0"):
        DanceSDEStrategy(-0.1)
    with pytest.raises(ValueError, match=r"stage\.sde must be one of \['cps', 'dance', 'flow'\], got 'sde'"):
        make_strategy("sde", 0.7)
