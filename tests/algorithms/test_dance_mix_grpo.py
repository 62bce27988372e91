"""DanceGRPO and MixGRPO are Flow-GRPO's loss on their SDE and SDE-step scheduler: through the
real SD3Stage (tiny model), rollout and replay agree on every strategy and sampling layout, the
first ratio is exactly 1, and the sampling knobs do what the methods ask; on a stand-in linear
denoiser (`tests/algorithms/linear_stage.py`), the loss with its advantage clip is their training
loops' (no Ray)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.algorithms.linear_stage import (
    LinearStage,
    sampled_track,
)
from tests.algorithms.test_flow_grpo import check_advantage_clip
from tests.conftest import tiny_model_config
from unirl.algorithms.advantages import track_advantages
from unirl.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl.models.sd3 import SD3Stage
from unirl.rollout.trainside import TrainsideEngine
from unirl.sde.schedules import sigmas_for
from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend
from unirl.train.stack import TrainStack, TrainStackConfig
from unirl.types import AdvantageConfig, DiffusionSamplingParams, PromptExample, RolloutReq

BASE = dict(num_steps=6, samples_per_prompt=4, height=16, width=16, guidance_scale=2.0, max_sequence_length=8)
LAYOUTS = {
    # DanceGRPO: the whole chain stochastic, one x_T per group, a random subset of steps trained
    "dance": dict(
        eta=0.5,
        sde_scheduler="random",
        sde_num_steps=3,
        sde_window=(0.0, 0.84),
        noise_all_steps=True,
        same_initial_noise=True,
    ),
    # MixGRPO(-Flash): SDE in a sliding window, ODE elsewhere (second order with dpmpp_2m)
    "mix": dict(
        eta=0.7,
        sde_scheduler="sliding",
        sde_num_steps=2,
        sde_window=(0.0, 0.84),
        sde_iters_per_window=1,
        ode_solver="dpmpp_2m",
    ),
}


@pytest.fixture(scope="module")
def bundle():
    return tiny_model_config().build()


def request(stage: SD3Stage, sp: DiffusionSamplingParams, rollout_id: int = 0) -> RolloutReq:
    sigmas = sigmas_for(sp, stage.bundle.image_seq_len(sp.height, sp.width))
    prompts = [PromptExample("a red square", "0"), PromptExample("a blue dot", "1")]
    return RolloutReq.from_prompts(prompts, sp, sigmas, rollout_id)


def rollout(stage: SD3Stage, sp: DiffusionSamplingParams, rollout_id: int = 0):
    track = (
        TrainsideEngine(stage, forward_batch_size=3)
        .generate(request(stage, sp, rollout_id))
        .track("diffusion")
    )
    track.rewards = track.media.float().mean(dim=(1, 2, 3))
    track_advantages(track, AdvantageConfig())
    return track


@pytest.mark.parametrize("sde", ["flow", "dance", "cps"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_rollout_log_probs_equal_replay_and_first_ratio_is_one(sde: str, layout: str) -> None:
    stage = SD3Stage(tiny_model_config().build(), replay_steps_per_forward=2, sde=sde)
    backend = TrainBackend(
        stage.module, LoRAConfig(rank=4, alpha=8), OptimConfig(lr=1e-2, weight_decay=0.0), 10
    )
    stage.module = backend.module
    sp = DiffusionSamplingParams(**{**BASE, **LAYOUTS[layout], "guidance_scale": 1.0})
    track = rollout(stage, sp, rollout_id=3)
    seg = track.segment
    assert seg.sde_indices == request(stage, sp, 3).sde_indices and len(seg.sde_indices) == sp.sde_num_steps
    with torch.no_grad():
        replayed = torch.cat(
            [stage.replay(seg, track.conditions, s)[0] for s in stage.replay_chunks(seg.sde_indices, seg)], 1
        )
    torch.testing.assert_close(replayed, seg.log_probs, rtol=0, atol=1e-5)
    stack = TrainStack(
        stage,
        backend,
        FlowGRPO(FlowGRPOConfig(clip_range=0.2, old_logp_source="replay")),
        TrainStackConfig(micro_batch_size=8, num_updates_per_batch=2),
    )
    metrics = stack.train_track(track, progress=0.0)
    assert metrics["ratio/first_update_mean"] == 1.0
    assert metrics["ratio/min"] < 1.0 < metrics["ratio/max"]  # the second update moved


@pytest.mark.parametrize(
    ("sde", "eta", "steps"),
    [
        ("dance", 0.4, (0, 2, 3)),  # DanceGRPO: the Dance SDE on a random subset, the last step left out
        ("flow", 0.7, (1, 2)),  # MixGRPO: Flow-GRPO's SDE on a window of consecutive steps
    ],
    ids=["dance", "mix"],
)
@pytest.mark.parametrize("rows", [[0, 1, 2, 3], [0], [2]])
def test_advantage_clip_matches_the_reference_training_loops(sde, eta, steps, rows) -> None:
    """DanceGRPO (XueZeyue/DanceGRPO, fastvideo/train_grpo_flux.py, `train_one_step`) and MixGRPO
    (Tencent-Hunyuan/MixGRPO, fastvideo/train_grpo_flux.py, `train_one_step`) clamp the advantage to
    +-adv_clip_max (their default 5.0) in both PPO terms, the policy loss of yifan123/flow_grpo's
    scripts/train_sd3.py (`flow_grpo_reference_loss`). Flow-GRPO's default config on their SDE and
    steps gives that loss and gradient to 1e-5 relative, on the batch, a clipped row and a kept row."""
    stage = LinearStage(sde=sde)
    check_advantage_clip(stage, sampled_track(stage, sde_indices=steps, eta=eta), rows)


def test_noise_all_steps_makes_the_unscored_steps_stochastic(bundle) -> None:
    """DanceGRPO's siblings share x_T: with ODE steps before the first SDE step they reach it at
    one point; with every step noised they reach it apart. Only the SDE step keeps a log-prob."""
    stage = SD3Stage(bundle)
    sp = DiffusionSamplingParams(
        **BASE, eta=0.5, sde_scheduler="fixed", sde_steps=[3], same_initial_noise=True
    )
    ode_before = stage_segment(stage, sp)
    noisy = stage_segment(stage, dataclasses.replace(sp, noise_all_steps=True))
    assert ode_before.positions == noisy.positions == [3, 4, 6]
    assert noisy.log_probs.shape == ode_before.log_probs.shape == (8, 1)
    group = slice(0, 4)
    at_sde_step = ode_before.at(3)[group]
    assert torch.equal(at_sde_step, at_sde_step[:1].expand_as(at_sde_step))
    spread = noisy.at(3)[group]
    assert (spread - spread[:1]).abs().amax(dim=(1, 2, 3))[1:].min() > 1e-3


def test_second_order_solver_changes_only_the_ode_steps(bundle) -> None:
    """MixGRPO-Flash: the window's SDE steps (and their log-probs) are as with Euler when the
    window starts at step 0; the ODE steps after it, and so the final sample, differ."""
    stage = SD3Stage(bundle)
    sp = DiffusionSamplingParams(**{**BASE, **LAYOUTS["mix"], "ode_solver": "euler"})
    euler = stage_segment(stage, sp, rollout_id=0)
    second = stage_segment(stage, dataclasses.replace(sp, ode_solver="dpmpp_2m"), rollout_id=0)
    assert euler.sde_indices == second.sde_indices == [0, 1]
    for p in (0, 1, 2):
        assert torch.equal(euler.at(p), second.at(p))
    assert torch.equal(euler.log_probs, second.log_probs)
    assert not torch.allclose(euler.at(6), second.at(6))
    # a later window: the ODE steps before it differ too, the replay still agrees
    later = stage_segment(stage, dataclasses.replace(sp, ode_solver="dpmpp_2m"), rollout_id=2)
    assert later.sde_indices == [2, 3]


def stage_segment(stage: SD3Stage, sp: DiffusionSamplingParams, rollout_id: int = 0):
    req = request(stage, sp, rollout_id)
    cond = stage.encode_prompts(req.prompts, sp.guidance_scale, sp.max_sequence_length)
    return stage.diffuse(req, cond)
