"""DiffusionNFT loss against hand-derived gradients, its draws and its first-update invariant (no Ray)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model_config
from unirl.algorithms.advantages import track_advantages
from unirl.algorithms.diffusion_nft import (
    V_OLD_KEY,
    DiffusionNFT,
    DiffusionNFTConfig,
    nft_loss,
    optimality,
)
from unirl.models.sd3 import SD3Stage
from unirl.rollout.trainside import TrainsideEngine
from unirl.sde.schedules import sigmas_for
from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend
from unirl.train.stack import TrainStack, TrainStackConfig
from unirl.types import AdvantageConfig, DiffusionSamplingParams, PromptExample, RolloutReq


def test_optimality_maps_clipped_advantages_to_unit_interval():
    adv = torch.tensor([-7.0, -5.0, -2.5, 0.0, 1.0, 5.0, 9.0])
    expected = torch.tensor([0.0, 0.0, 0.25, 0.5, 0.6, 1.0, 1.0])
    torch.testing.assert_close(optimality(adv, 5.0), expected)


def _random_inputs(n: int = 6, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    shape = (n, 3, 4, 4)
    x0 = torch.randn(shape, generator=g)
    eps = torch.randn(shape, generator=g)
    sigma = torch.rand(n, generator=g) * 0.8 + 0.1
    s = sigma.view(-1, 1, 1, 1)
    x_t = (1 - s) * x0 + s * eps
    v_old = torch.randn(shape, generator=g)
    return x0, x_t, sigma, v_old


def test_first_update_gradient_is_advantage_weighted_flow_matching():
    """At v_new = v_old both implicit predictions coincide, so dL/dv_new equals
    c/N * (2r - 1) * d/dv [mean((x_t - s v - x0)^2) / sg(mean|x_t - s v - x0|)], computed by hand."""
    x0, x_t, sigma, v_old = _random_inputs()
    n, d = x0.shape[0], x0[0].numel()
    adv = torch.tensor([-2.0, -0.5, 0.0, 0.3, 1.5, 6.0])
    c, beta = 5.0, 1.0
    r = optimality(adv, c)
    v_new = v_old.clone().requires_grad_(True)
    nft_loss(v_new, v_old, x_t, x0, sigma, r, beta, c).backward()
    s = sigma.view(-1, 1, 1, 1)
    err = x_t - s * v_old - x0
    scale = err.abs().flatten(1).mean(1).view(-1, 1, 1, 1)
    expected = (c / n) * (2 * r - 1).view(-1, 1, 1, 1) * (-2 * s * err / (scale * d))
    torch.testing.assert_close(v_new.grad, expected, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("beta", [0.3, 1.0, 2.0])
def test_loss_is_the_papers_implicit_positive_and_negative_objective(beta):
    x0, x_t, sigma, v_old = _random_inputs(seed=1)
    g = torch.Generator().manual_seed(2)
    v_new = v_old + 0.3 * torch.randn(v_old.shape, generator=g)
    r = torch.tensor([0.0, 0.2, 0.5, 0.7, 1.0, 0.9])
    s = sigma.view(-1, 1, 1, 1)
    ref = []
    for v in (beta * v_new + (1 - beta) * v_old, (1 + beta) * v_old - beta * v_new):
        e = x_t - s * v - x0
        ref.append((e**2).flatten(1).mean(1) / e.abs().flatten(1).mean(1))
    expected = 5.0 * (r * ref[0] + (1 - r) * ref[1]).mean() / beta
    torch.testing.assert_close(nft_loss(v_new, v_old, x_t, x0, sigma, r, beta, 5.0), expected)


@pytest.mark.parametrize(
    "kwargs, key",
    [
        ({"beta": 0.0}, "beta"),
        ({"adv_clip": -1.0}, "adv_clip"),
        ({"draws_per_sample": 0}, "draws_per_sample"),
    ],
)
def test_config_rejects_bad_values_naming_the_key(kwargs, key):
    with pytest.raises(ValueError, match=f"algorithm.config.{key}"):
        DiffusionNFTConfig(**kwargs)


def make_setup(updates: int = 1, draws: int = 2, micro: int = 4):
    bundle = tiny_model_config().build()
    stage = SD3Stage(bundle)
    backend = TrainBackend(
        stage.module, LoRAConfig(rank=4, alpha=8), OptimConfig(lr=1e-2, weight_decay=0.0), 10
    )
    stage.module = backend.module
    algo = DiffusionNFT(DiffusionNFTConfig(draws_per_sample=draws))
    stack = TrainStack(
        stage, backend, algo, TrainStackConfig(micro_batch_size=micro, num_updates_per_batch=updates)
    )
    sp = DiffusionSamplingParams(
        num_steps=4,
        samples_per_prompt=4,
        height=16,
        width=16,
        guidance_scale=2.0,
        eta=0.0,
        max_sequence_length=8,
    )
    sigmas = sigmas_for(sp, bundle.image_seq_len(sp.height, sp.width))
    req = RolloutReq.from_prompts(
        [PromptExample("a red square", "0"), PromptExample("a blue dot", "1")], sp, sigmas, rollout_id=3
    )
    track = TrainsideEngine(stage, forward_batch_size=3).generate(req).track("diffusion")
    track.rewards = track.media.float().mean(dim=(1, 2, 3))
    track_advantages(track, AdvantageConfig())
    return stage, backend, algo, stack, track


def test_draws_depend_only_on_the_sample_and_come_from_the_rollout_sigmas():
    stage, _, algo, _, track = make_setup(draws=3)
    whole = algo.prepare_segment(stage, track)
    part = algo.prepare_segment(stage, track.select([5, 2]))
    for key in ("nft/sigma", "nft/noise"):
        torch.testing.assert_close(part.conditions[key], whole.conditions[key][[5, 2]], rtol=0, atol=0)
    sig = whole.conditions["nft/sigma"]
    assert sig.shape == (len(track), 3)
    assert all(any(torch.isclose(s, track.segment.sigmas[:-1]).tolist()) for s in sig.flatten())
    assert whole.conditions[V_OLD_KEY].shape == (len(track), 3, *track.segment.final.shape[1:])
    assert "nft/sigma" not in track.conditions  # the input track is left as it was


def test_first_update_starts_on_policy_and_later_updates_move_away():
    """v_old is the sampling weights' velocity: the first update's v_new equals it
    exactly; the second update runs on moved weights against the same frozen v_old."""
    stage, backend, algo, stack, track = make_setup(updates=2)
    before = {n: p.detach().clone() for n, p in backend.named_params}
    micro = [algo.prepare_segment(stage, track.select(list(range(i, i + 4)))) for i in (0, 4)]
    first = [algo.compute_loss_and_backward(stage, mb, {"loss_scale": 0.5}) for mb in micro]
    assert all(m["nft/v_drift_mse"] == 0.0 for m in first)
    backend.optimizer_step()
    second = [algo.compute_loss_and_backward(stage, mb, {"loss_scale": 0.5}) for mb in micro]
    assert all(m["nft/v_drift_mse"] > 0.0 for m in second)
    assert any(not torch.equal(before[n], p) for n, p in backend.named_params)


def test_train_stack_runs_nft_and_reports_its_metrics():
    _, _, _, stack, track = make_setup(updates=2)
    out = stack.train_track(track, progress=0.0)
    assert {"loss", "nft/optimality_mean", "nft/v_drift_mse", "nft/x0_error", "train/grad_norm"} <= set(out)
    assert abs(out["nft/optimality_mean"] - 0.5) < 1e-5  # group advantages are zero-mean


def test_loss_needs_advantages_and_a_prepared_track():
    stage, _, algo, _, track = make_setup()
    with pytest.raises(ValueError, match="not prepared"):
        algo.compute_loss_and_backward(stage, track, {"loss_scale": 1.0})
    track.advantages = None
    with pytest.raises(ValueError, match="no advantages"):
        algo.compute_loss_and_backward(stage, algo.prepare_segment(stage, track), {"loss_scale": 1.0})
