"""The forward-process base: its timestep samplers against their closed-form distributions
(Kolmogorov-Smirnov, written out here: scipy is not a dependency), the discrete candidates,
per-sample vs per-group draws and the errors that name their keys (no Ray, no model)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.algorithms.linear_stage import SIGMAS, LinearStage, sampled_track
from unirl.algorithms.awm import AWM, AWMConfig
from unirl.algorithms.forward_process import ForwardProcessConfig, discrete_candidates, draw_sigmas
from unirl.types import DiffusionSamplingParams

N = 4000
KS_CRIT = math.sqrt(-math.log(1e-3 / 2) / 2) / math.sqrt(N)  # Kolmogorov's alpha = 0.001 bound


def draws(cfg: ForwardProcessConfig, seed: int = 0) -> torch.Tensor:
    return draw_sigmas(torch.Generator().manual_seed(seed), N, cfg, SIGMAS, len(SIGMAS) - 1).double()


def ks_statistic(x: torch.Tensor, cdf) -> float:
    """sup |F_n - F| of the sample x under the continuous cdf."""
    x, _ = torch.sort(x)
    f = cdf(x)
    i = torch.arange(1, len(x) + 1, dtype=torch.float64)
    return float(torch.maximum(i / len(x) - f, f - (i - 1) / len(x)).max())


def unshift(w: torch.Tensor, k: float) -> torch.Tensor:
    """The inverse of w = k u / (1 + (k - 1) u)."""
    return w / (k - (k - 1) * w)


@pytest.mark.parametrize("k, lo, hi", [(1.0, 0.0, 1.0), (3.0, 0.0, 1.0), (3.0, 0.2, 0.9)])
def test_uniform_sampler_matches_its_closed_form(k, lo, hi):
    x = draws(
        ForwardProcessConfig(timestep_distribution="uniform", timestep_shift=k, timestep_range=(lo, hi))
    )
    assert float(x.min()) >= lo and float(x.max()) <= hi
    assert ks_statistic(x, lambda s: unshift((s - lo) / (hi - lo), k)) < KS_CRIT


@pytest.mark.parametrize("k, lo, hi", [(1.0, 0.0, 1.0), (3.0, 0.4, 1.0)])
def test_logit_normal_sampler_matches_its_closed_form(k, lo, hi):
    cfg = ForwardProcessConfig(
        timestep_distribution="logit_normal", timestep_shift=k, timestep_range=(lo, hi)
    )
    x = draws(cfg, seed=1)

    def cdf(s):
        u = unshift((s - lo) / (hi - lo), k).clamp(1e-12, 1 - 1e-12)
        return torch.special.ndtr(torch.log(u / (1 - u)))

    assert ks_statistic(x, cdf) < KS_CRIT
    # the shift moves mass toward noise: the median is the shifted median of sigmoid(N(0, 1)) = 0.5
    assert float(x.median()) == pytest.approx(lo + (hi - lo) * k * 0.5 / (1 + (k - 1) * 0.5), abs=0.03)


@pytest.mark.parametrize(
    "dist, rng, atoms",
    [
        ("discrete_with_init", (0.0, 1.0), [1.0, 0.8, 0.55, 0.3, 0.1]),
        ("discrete", (0.0, 1.0), [0.8, 0.55, 0.3, 0.1]),
        ("discrete", (0.25, 0.9), [0.8, 0.55, 0.3]),
    ],
)
def test_discrete_samplers_are_uniform_over_the_schedule_sigmas_in_range(dist, rng, atoms):
    x = draws(ForwardProcessConfig(timestep_distribution=dist, timestep_range=rng), seed=2)
    atoms_t = torch.tensor(sorted(atoms)).double()  # the schedule's fp32 values
    assert torch.equal(x.unique(), atoms_t)
    emp = torch.stack([(x <= a).double().mean() for a in atoms_t])
    exact = torch.arange(1, len(atoms) + 1, dtype=torch.float64) / len(atoms)
    assert float((emp - exact).abs().max()) < KS_CRIT  # conservative for a discrete law


def test_a_discrete_range_without_schedule_sigmas_is_refused_naming_the_key():
    cfg = ForwardProcessConfig(timestep_distribution="discrete", timestep_range=(0.85, 0.95))
    with pytest.raises(ValueError, match="algorithm.config.timestep_range"):
        discrete_candidates(SIGMAS, len(SIGMAS) - 1, cfg)
    # and before Ray, against the recipe's own schedule (10 steps, shift 3)
    sampling = DiffusionSamplingParams(num_steps=10, shift=3.0, eta=0.0, samples_per_prompt=2)
    AWM(AWMConfig(timestep_range=(0.3, 1.0))).check_sampling(sampling)
    with pytest.raises(ValueError, match="algorithm.config.timestep_range"):
        AWM(AWMConfig(timestep_range=(0.9991, 0.9999))).check_sampling(sampling)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"timestep_distribution": "beta"}, "timestep_distribution"),
        ({"timestep_range": (0.5, 0.5)}, "timestep_range"),
        ({"timestep_range": (-0.1, 1.0)}, "timestep_range"),
        ({"timestep_range": (0.0, 1.2)}, "timestep_range"),
        ({"timestep_range": (0.1,)}, "timestep_range"),
        ({"timestep_shift": 0.0}, "timestep_shift"),
        ({"timestep_shift": 3.0}, "timestep_shift"),  # discrete_with_init: the schedule is already shifted
        ({"draws_per_sample": 0}, "draws_per_sample"),
    ],
)
def test_config_errors_name_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"algorithm.config.{key}"):
        ForwardProcessConfig(**kwargs)


@pytest.mark.parametrize("shared", [False, True])
def test_draws_are_per_sample_or_shared_by_a_group(shared):
    track = sampled_track(LinearStage(), n=4)
    algo = AWM(AWMConfig(timestep_distribution="uniform", shared_noise=shared, draws_per_sample=2))
    sigma, noise = algo.draws(track)
    assert sigma.shape == (4, 2) and noise.shape == (4, 2, *track.segment.final.shape[1:])
    # groups are (s0, s1) and (s2, s3)
    assert torch.equal(noise[0], noise[1]) == shared and torch.equal(sigma[2], sigma[3]) == shared
    assert not torch.equal(noise[1], noise[2])
    part_sigma, part_noise = algo.draws(track.select([3, 0]))
    assert torch.equal(part_sigma, sigma[[3, 0]]) and torch.equal(part_noise, noise[[3, 0]])
