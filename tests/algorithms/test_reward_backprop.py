"""DRaFT-K / DRaFT-LV, AlignProp and ReFL: gradients against finite differences of loops written
here, truncation, reproducibility, the regulariser and the errors (no Ray)."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model_config
from unirl.algorithms.alignprop import AlignProp, AlignPropConfig
from unirl.algorithms.draft import DRaFT, DRaFTConfig
from unirl.algorithms.refl import ReFL, ReFLConfig
from unirl.algorithms.reward_backprop import sample_generator
from unirl.models.sd3 import SD3Stage
from unirl.rollout.trainside import TrainsideEngine
from unirl.sde.schedules import sigmas_for
from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend
from unirl.train.stack import TrainStack, TrainStackConfig
from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

T = 4


class QuadraticReward:
    """A smooth differentiable test reward: -mean((image - target_p)^2), target by prompt."""

    def score_differentiable(self, images, prompts, metadata):
        target = torch.stack([torch.full((3, 1, 1), 0.2 if "red" in p else 0.8) for p in prompts])
        return -((images - target) ** 2).mean(dim=(1, 2, 3))


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    bundle = tiny_model_config().build()
    stage = SD3Stage(bundle, store_trajectory=True, detach_uncond=False)
    sp = DiffusionSamplingParams(
        num_steps=T,
        samples_per_prompt=2,
        height=16,
        width=16,
        guidance_scale=2.0,
        eta=0.0,
        shift=1.0,
        max_sequence_length=8,
    )
    sigmas = sigmas_for(sp, bundle.image_seq_len(16, 16))
    req = RolloutReq.from_prompts(
        [PromptExample("a red square", "0"), PromptExample("a blue dot", "1")], sp, sigmas, rollout_id=3
    )
    track = TrainsideEngine(stage).generate(req).track("diffusion")
    return stage, track


def params(stage):
    return [p for p in stage.module.parameters() if p.requires_grad]


def grad_of(algo, stage, track, ctx=None):
    for p in params(stage):
        p.grad = None
    metrics = algo.compute_loss_and_backward(stage, track, {"loss_scale": 1.0, **(ctx or {})})
    return [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in params(stage)], metrics


def euler_chain(stage, track, x, start, rows=None):
    """The sampler written out: Euler steps start..T-1 with the guided velocity (x: the
    samples `rows`, all by default)."""
    seg = track.segment
    cond = track.conditions if rows is None else {k: c[rows] for k, c in track.conditions.items()}
    for i in range(start, T):
        v = stage.velocity(x, seg.sigmas[i].expand(len(x)), cond, seg.guidance_scale)
        x = x + (seg.sigmas[i + 1] - seg.sigmas[i]) * v
    return x


def reward_loss(track, x, rows=None):
    rows = list(range(len(track))) if rows is None else rows
    images = (x.clamp(-1, 1) + 1) / 2
    return -QuadraticReward().score_differentiable(images, [track.prompts[r] for r in rows], []).mean()


def unit(vectors):
    norm = torch.sqrt(sum((x**2).sum() for x in vectors))
    return [x / norm for x in vectors]


def directional_fd(stage, f, grads, h: float = 0.01, seed: int = 0):
    """(direction d over the trainable parameters, (f(theta + h d) - f(theta - h d)) / 2h).

    d is half a random unit vector and half the gradient's direction, so the derivative along
    it stands well above the fp32 resolution of f (the velocity is fp32) whatever the seed."""
    g = torch.Generator().manual_seed(seed)
    rand = unit([torch.randn(p.shape, generator=g) for p in params(stage)])
    d = unit([r + x for r, x in zip(rand, unit(grads), strict=True)])
    vals, saved = [], [p.detach().clone() for p in params(stage)]
    with torch.no_grad():
        for sign in (1, -1):
            for p, x in zip(params(stage), d, strict=True):
                p.add_(sign * h * x)
            vals.append(float(f()))
            for p, x in zip(params(stage), saved, strict=True):
                p.copy_(x)  # exactly restored (p + hd - hd is not p in floats)
    return d, (vals[0] - vals[1]) / (2 * h)


def dot(grads, d):
    return float(sum((g * x).sum() for g, x in zip(grads, d, strict=True)))


@pytest.mark.parametrize("k", [2, 3, T])
def test_draft_k_gradient_is_the_truncated_chains_against_finite_differences(setup, k):
    stage, track = setup
    algo = DRaFT(QuadraticReward(), DRaFTConfig(steps=k))
    grads, metrics = grad_of(algo, stage, track)
    seg = track.segment
    assert metrics["backprop/x0_drift"] == 0.0  # the re-run is the rollout's own sample
    with torch.no_grad():
        assert metrics["loss"] == pytest.approx(
            float(reward_loss(track, euler_chain(stage, track, seg.at(T - k), T - k))), rel=1e-5
        )
    d, fd = directional_fd(
        stage, lambda: reward_loss(track, euler_chain(stage, track, seg.at(T - k), T - k)), grads
    )
    assert dot(grads, d) == pytest.approx(fd, rel=2e-2)
    if k < T:  # truncation is real: the whole chain's derivative is another number
        _, full = directional_fd(
            stage, lambda: reward_loss(track, euler_chain(stage, track, seg.at(0), 0)), grads
        )
        assert abs(full - fd) > 0.05 * abs(full)


def test_no_gradient_reaches_steps_before_each_samples_window(setup, monkeypatch):
    """A zero tap added to the velocity of every step: its gradient is 0 before a sample's
    truncation point and non-zero inside the window (AlignProp draws K per sample)."""
    stage, track = setup
    algo = AlignProp(QuadraticReward(), AlignPropConfig(min_steps=1, max_steps=3, checkpoint=False))
    ks = algo.truncations(track)
    assert len(set(ks)) > 1  # the draw differs between samples
    seg = track.segment
    taps = {i: torch.zeros((len(track), *seg.final.shape[1:]), requires_grad=True) for i in range(T)}
    velocity = stage.velocity

    def tapped(x, sigma, cond, g):
        i = int(torch.isclose(seg.sigmas[:-1], sigma[0]).nonzero()[0])
        return velocity(x, sigma, cond, g) + taps[i]

    monkeypatch.setattr(stage, "velocity", tapped)
    grad_of(algo, stage, track)
    for i, tap in taps.items():
        for b, k in enumerate(ks):
            g = tap.grad[b] if tap.grad is not None else torch.zeros(1)
            if i < T - k:
                assert float(g.abs().max()) == 0.0, (i, b, k)
            else:
                assert float(g.abs().max()) > 0.0, (i, b, k)


def test_alignprop_gradient_against_per_sample_truncated_chains(setup):
    stage, track = setup
    algo = AlignProp(QuadraticReward(), AlignPropConfig(min_steps=1, max_steps=T, seed=3))
    ks = algo.truncations(track)
    grads, metrics = grad_of(algo, stage, track)
    assert metrics["backprop/steps_mean"] == pytest.approx(sum(ks) / len(ks))
    seg = track.segment

    def loss():
        x = torch.cat(
            [euler_chain(stage, track, seg.at(T - k)[b : b + 1], T - k, [b]) for b, k in enumerate(ks)]
        )
        return reward_loss(track, x)

    d, fd = directional_fd(stage, loss, grads, seed=1)
    assert dot(grads, d) == pytest.approx(fd, rel=2e-2)
    no_ckpt, _ = grad_of(
        AlignProp(QuadraticReward(), AlignPropConfig(min_steps=1, max_steps=T, seed=3, checkpoint=False)),
        stage,
        track,
    )
    for a, b in zip(grads, no_ckpt, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-9)


def test_draft_lv_averages_the_renoised_copies(setup):
    stage, track = setup
    k, n = 2, 3
    algo = DRaFT(QuadraticReward(), DRaFTConfig(steps=k, lv_draws=n, seed=5))
    grads, _ = grad_of(algo, stage, track)
    seg = track.segment
    sigma = seg.sigmas[T - k]
    eps = torch.cat(
        [
            torch.randn((n, *seg.final.shape[1:]), generator=sample_generator(5, sid, "lv"))
            for sid in track.sample_ids
        ]
    )
    rows = [b for b in range(len(track)) for _ in range(n)]
    rep = track.conditions

    def loss():
        x = (1 - sigma) * seg.final[rows] + sigma * eps
        out = x
        for i in range(T - k, T):
            v = stage.velocity(
                out,
                seg.sigmas[i].expand(len(out)),
                {key: c[rows] for key, c in rep.items()},
                seg.guidance_scale,
            )
            out = out + (seg.sigmas[i + 1] - seg.sigmas[i]) * v
        return reward_loss(track, out, rows)

    d, fd = directional_fd(stage, loss, grads, seed=2)
    assert dot(grads, d) == pytest.approx(fd, rel=2e-2)


def test_refl_scores_the_one_step_x0_prediction(setup):
    stage, track = setup
    algo = ReFL(QuadraticReward(), ReFLConfig(step_window=(0.25, 1.0), seed=1))
    assert list(algo.step_range(T)) == [1, 2, 3]
    grads, metrics = grad_of(algo, stage, track)
    seg = track.segment
    ts = [
        [1, 2, 3][int(torch.randint(0, 3, (1,), generator=sample_generator(1, sid, "refl")))]
        for sid in track.sample_ids
    ]
    assert metrics["backprop/sigma_mean"] == pytest.approx(float(seg.sigmas[ts].mean()))

    def loss():
        x0 = []
        for b, t in enumerate(ts):
            x = seg.at(t)[b : b + 1]
            cond = {key: c[b : b + 1] for key, c in track.conditions.items()}
            x0.append(
                x - seg.sigmas[t] * stage.velocity(x, seg.sigmas[t].expand(1), cond, seg.guidance_scale)
            )
        return reward_loss(track, torch.cat(x0))

    d, fd = directional_fd(stage, loss, grads, seed=3)
    assert dot(grads, d) == pytest.approx(fd, rel=2e-2)


def test_draws_depend_on_the_sample_not_the_batch_and_runs_reproduce(setup):
    stage, track = setup
    algo = AlignProp(QuadraticReward(), AlignPropConfig(seed=7))
    assert algo.truncations(track.select([3, 1])) == [algo.truncations(track)[i] for i in (3, 1)]
    a, _ = grad_of(algo, stage, track)
    b, _ = grad_of(AlignProp(QuadraticReward(), AlignPropConfig(seed=7)), stage, track)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert AlignProp(QuadraticReward(), AlignPropConfig(seed=8)).truncations(track) != algo.truncations(track)


def test_kl_regulariser_is_the_velocity_l2_to_the_lora_disabled_base():
    bundle = tiny_model_config().build()
    stage = SD3Stage(bundle, store_trajectory=True, detach_uncond=False)
    backend = TrainBackend(
        stage.module, LoRAConfig(rank=4, alpha=8), OptimConfig(lr=1e-2, weight_decay=0.0), 10
    )
    stage.module = backend.module
    sp = DiffusionSamplingParams(
        num_steps=T,
        samples_per_prompt=2,
        height=16,
        width=16,
        guidance_scale=2.0,
        eta=0.0,
        max_sequence_length=8,
    )
    req = RolloutReq.from_prompts(
        [PromptExample("a red square", "0")], sp, sigmas_for(sp, bundle.image_seq_len(16, 16)), 0
    )
    track = TrainsideEngine(stage).generate(req).track("diffusion")
    algo = DRaFT(QuadraticReward(), DRaFTConfig(steps=2, kl_coef=0.5, kl_steps=2))
    assert algo.needs_reference_policy
    ctx = {"loss_scale": 1.0, "reference": backend.reference}
    assert algo.compute_loss_and_backward(stage, track, ctx)["kl"] == 0.0  # LoRA B = 0: the base itself
    with torch.no_grad():
        for p in backend.params:
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    out = algo.compute_loss_and_backward(stage, track, ctx)
    seg = track.segment
    js = [
        torch.randint(0, T, (2,), generator=sample_generator(0, sid, "kl")).tolist()
        for sid in track.sample_ids
    ]
    with torch.no_grad():
        diffs = []
        for b, j2 in enumerate(js):
            cond = {key: c[b : b + 1] for key, c in track.conditions.items()}
            for j in j2:
                x, s = seg.at(j)[b : b + 1], seg.sigmas[j].expand(1)
                v = stage.velocity(x, s, cond, seg.guidance_scale)
                with backend.reference():
                    v_ref = stage.velocity(x, s, cond, seg.guidance_scale)
                diffs.append(((v - v_ref) ** 2).mean())
    assert out["kl"] == pytest.approx(float(torch.stack(diffs).mean()), rel=1e-4)
    assert out["kl"] > 0
    stack = TrainStack(stage, backend, algo, TrainStackConfig(micro_batch_size=1))
    track.rewards = torch.zeros(len(track))
    metrics = stack.train_track(track, 0.0)
    assert {"loss", "kl", "backprop/reward_mean", "train/grad_norm"} <= set(metrics)


def test_errors_name_what_to_set(setup, tiny_bundle):
    stage, track = setup
    with pytest.raises(TypeError, match="algorithm.reward must be a differentiable reward"):
        DRaFT(object())
    with pytest.raises(ValueError, match="algorithm.config.steps must be >= 1"):
        DRaFTConfig(steps=0)
    with pytest.raises(
        ValueError, match="algorithm.config.max_steps=1 must be >= algorithm.config.min_steps=2"
    ):
        AlignPropConfig(min_steps=2, max_steps=1)
    with pytest.raises(ValueError, match="step_window must satisfy"):
        ReFLConfig(step_window=(0.5, 0.5))
    with pytest.raises(ValueError, match="algorithm.config.steps=5 exceeds"):
        grad_of(DRaFT(QuadraticReward(), DRaFTConfig(steps=5)), stage, track)
    plain = SD3Stage(tiny_bundle)  # no stored trajectory
    sp = DiffusionSamplingParams(
        num_steps=T, samples_per_prompt=1, height=16, width=16, eta=0.0, max_sequence_length=8
    )
    req = RolloutReq.from_prompts(
        [PromptExample("a red square", "0")], sp, sigmas_for(sp, tiny_bundle.image_seq_len(16, 16)), 0
    )
    short = TrainsideEngine(plain).generate(req).track("diffusion")
    with pytest.raises(ValueError, match="set stage.store_trajectory: true"):
        DRaFT(QuadraticReward()).compute_loss_and_backward(plain, short, {"loss_scale": 1.0})
    sde = DiffusionSamplingParams(
        num_steps=T, samples_per_prompt=1, height=16, width=16, eta=0.7, max_sequence_length=8
    )
    req = RolloutReq.from_prompts(
        [PromptExample("a red square", "0")], sde, sigmas_for(sde, tiny_bundle.image_seq_len(16, 16)), 0
    )
    noisy = TrainsideEngine(stage).generate(req).track("diffusion")
    with pytest.raises(ValueError, match="set sampling.eta: 0"):
        DRaFT(QuadraticReward()).compute_loss_and_backward(stage, noisy, {"loss_scale": 1.0})


class PositiveReward:
    """exp(-mean((image - 0.3)^2) * 5): a smooth reward in (0, 1]."""

    def score_differentiable(self, images, prompts, metadata):
        return torch.exp(-5 * ((images - 0.3) ** 2).mean(dim=(1, 2, 3)))


def test_log_transform_differentiates_the_log_reward(setup):
    stage, track = setup
    seg = track.segment
    algo = DRaFT(PositiveReward(), DRaFTConfig(steps=2, reward_transform="log", reward_scale=2.0))
    grads, metrics = grad_of(algo, stage, track)

    def loss():
        images = (euler_chain(stage, track, seg.at(T - 2), T - 2).clamp(-1, 1) + 1) / 2
        return -2.0 * PositiveReward().score_differentiable(images, [], []).clamp(min=1e-30).log().mean()

    with torch.no_grad():
        assert metrics["loss"] == pytest.approx(float(loss()), rel=1e-5)
    d, fd = directional_fd(stage, loss, grads, seed=4)
    assert dot(grads, d) == pytest.approx(fd, rel=2e-2)
    with pytest.raises(ValueError, match="algorithm.config.reward_transform must be one of"):
        DRaFTConfig(reward_transform="sqrt")
