"""Batched-step replay: several SDE steps of a sample replayed in one denoiser forward give the
per-step replay's log-probs, means and gradients (issue 45, item 4), and a token budget picks the
number of steps per forward (no Ray)."""

from __future__ import annotations

import pytest
import torch

from tests.algorithms.linear_stage import assert_relative
from tests.algorithms.test_flow_grpo import make_setup, scored_track
from tests.conftest import tiny_model_config
from unirl.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl.models.sd3 import SD3Stage


@pytest.fixture(scope="module")
def setup():
    torch.manual_seed(0)
    stage, backend, _, sp = make_setup(FlowGRPOConfig(clip_range=0.2, beta=0.04))
    track = scored_track(stage, sp)
    with torch.no_grad():  # off the sampling weights and the reference: ratios != 1, KL > 0
        for p in backend.module.parameters():
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
    return stage, backend, track


def chunked(stage, per_forward: int | None, budget: int | None = None):
    stage.replay_steps_per_forward = per_forward or 1
    stage.replay_token_budget = budget


def test_replay_of_stacked_steps_equals_one_step_at_a_time(setup):
    stage, _, track = setup
    seg, cond = track.segment, track.conditions
    steps = seg.sde_indices
    with torch.no_grad():
        together = stage.replay(seg, cond, steps)
        alone = [stage.replay(seg, cond, [i]) for i in steps]
    assert len(steps) == 4
    torch.testing.assert_close(together[0], torch.cat([a[0] for a in alone], 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(together[1], torch.cat([a[1] for a in alone], 1), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(together[2], torch.cat([a[2] for a in alone]), rtol=0, atol=0)


def loss_grads(stage, backend, track) -> tuple[dict, list[torch.Tensor]]:
    algo = FlowGRPO(FlowGRPOConfig(clip_range=0.2, beta=0.04))
    params = [p for p in backend.module.parameters() if p.requires_grad]
    for p in params:
        p.grad = None
    ctx = {"loss_scale": 1.0, "progress": 0.0, "reference": backend.reference}
    metrics = algo.compute_loss_and_backward(stage, track, ctx)
    return metrics, [p.grad.clone() for p in params]


@pytest.mark.parametrize("per_forward", [2, 4])
def test_batched_steps_train_like_per_step_replay(setup, per_forward):
    """The Flow-GRPO loss (policy + KL to the reference) backpropagated chunk by chunk: the
    gradient of every LoRA parameter and the loss metrics equal the per-step replay's (1e-5 of
    the gradient's norm; float rounding of a batched matmul is all that differs)."""
    stage, backend, track = setup
    chunked(stage, 1)
    want_metrics, want = loss_grads(stage, backend, track)
    chunked(stage, per_forward)
    got_metrics, got = loss_grads(stage, backend, track)
    assert_relative(got, want, 1e-5)
    for key in ("kl", "ratio/mean", "ratio/min", "ratio/max"):
        assert got_metrics[key] == pytest.approx(want_metrics[key], rel=1e-5), key
    for key in ("loss", "policy_loss"):  # a mean of O(1) terms that cancel (advantages sum to 0)
        assert got_metrics[key] == pytest.approx(want_metrics[key], abs=1e-7), key
    assert want_metrics["kl"] > 0 and want_metrics["ratio/min"] < 1 < want_metrics["ratio/max"]


def test_token_budget_picks_the_steps_of_a_forward(setup):
    stage, _, track = setup
    seg = track.segment
    per_sample = stage.tokens_per_sample(seg.at(seg.sde_indices[0]).shape[1:])
    c, h, w = seg.at(0).shape[1:]
    assert per_sample == h * w // stage.bundle.model_info()["patch_size"] ** 2
    per_step = len(seg) * per_sample
    steps = seg.sde_indices
    for budget, want in [
        (per_step - 1, [[i] for i in steps]),  # under one step: one step a forward
        (2 * per_step, [steps[:2], steps[2:]]),
        (3 * per_step + per_step // 2, [steps[:3], steps[3:]]),
        (100 * per_step, [steps]),
    ]:
        chunked(stage, 1, budget)
        assert list(stage.replay_chunks(steps, seg)) == want, budget
    chunked(stage, 3)  # without a budget the fixed count decides
    assert list(stage.replay_chunks(steps, seg)) == [steps[:3], steps[3:]]


def test_a_budget_trains_like_per_step_replay(setup):
    stage, backend, track = setup
    chunked(stage, 1)
    _, want = loss_grads(stage, backend, track)
    seg = track.segment
    chunked(stage, 1, 2 * len(seg) * stage.tokens_per_sample(seg.at(0).shape[1:]))
    _, got = loss_grads(stage, backend, track)
    assert_relative(got, want, 1e-5)


def test_a_budget_below_one_is_refused():
    with pytest.raises(ValueError, match="stage.replay_token_budget must be >= 1"):
        SD3Stage(tiny_model_config().build(), replay_token_budget=0)
