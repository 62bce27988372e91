"""The KL-control layer and the diffusion step losses built on the Flow-GRPO driver (DDPO,
DPOK, Flow-DPPO): each loss and its gradient against a direct computation of its formula,
masks, the adaptive controller, and the on-policy invariants (no Ray)."""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import tiny_model_config
from unirl.algorithms.advantages import track_advantages
from unirl.algorithms.ddpo import DDPO, DDPOConfig
from unirl.algorithms.dpok import DPOK, DPOKConfig, dpok_policy_loss
from unirl.algorithms.flow_dppo import OLD_MEANS_KEY, FlowDPPO, FlowDPPOConfig, dppo_policy_loss
from unirl.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl.algorithms.kl_control import KLController, step_kl, transition_std
from unirl.models.sd3 import SD3Stage
from unirl.rollout.trainside import TrainsideEngine
from unirl.sde.schedules import sigmas_for
from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend
from unirl.train.checkpoint import load_train_state, save_train_state
from unirl.train.stack import TrainStack, TrainStackConfig
from unirl.types import AdvantageConfig, DiffusionSamplingParams, PromptExample, RolloutReq


def make_setup(algorithm, micro: int = 8, updates: int = 1, lora: bool = True, sde: str = "flow"):
    bundle = tiny_model_config().build()
    stage = SD3Stage(bundle, replay_steps_per_forward=2, sde=sde)
    backend = TrainBackend(
        stage.module,
        LoRAConfig(rank=4, alpha=8) if lora else None,
        OptimConfig(lr=1e-2, weight_decay=0.0),
        10,
        keep_reference=algorithm.needs_reference_policy,
    )
    stage.module = backend.module
    stack = TrainStack(
        stage, backend, algorithm, TrainStackConfig(micro_batch_size=micro, num_updates_per_batch=updates)
    )
    sp = DiffusionSamplingParams(
        num_steps=4,
        samples_per_prompt=4,
        height=16,
        width=16,
        guidance_scale=2.0,
        eta=0.7,
        max_sequence_length=8,
        sde_scheduler="all",
    )
    return stage, backend, stack, sp


def scored_track(stage, sp, rollout_id: int = 0):
    sigmas = sigmas_for(sp, stage.bundle.image_seq_len(sp.height, sp.width))
    req = RolloutReq.from_prompts(
        [PromptExample("a red square", "0"), PromptExample("a blue dot", "1")], sp, sigmas, rollout_id
    )
    track = TrainsideEngine(stage, forward_batch_size=8).generate(req).track("diffusion")
    track.rewards = track.media.float().mean(dim=(1, 2, 3))
    track_advantages(track, AdvantageConfig())
    return track


def perturb(backend, scale: float = 0.05, seed: int = 0) -> None:
    """Move the trainable weights off the reference (LoRA B starts at zero)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in backend.params:
            p.add_(scale * torch.randn(p.shape, generator=gen))


def grads(backend) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in backend.params]


def direct_replay(stage, backend, track, with_reference: bool):
    """Every SDE step replayed one at a time: (new_logp [B, K], means, std_dev_t [K], ref_means)."""
    seg = track.segment
    logps, means, stds, refs = [], [], [], []
    for i in seg.sde_indices:
        if with_reference:
            with torch.no_grad(), backend.reference():
                refs.append(stage.replay(seg, track.conditions, [i])[1])
        lp, mu, sd = stage.replay(seg, track.conditions, [i])
        logps.append(lp)
        means.append(mu)
        stds.append(sd)
    ref = torch.cat(refs, 1) if with_reference else None
    return torch.cat(logps, 1), torch.cat(means, 1), torch.cat(stds), ref


def ctx_of(backend, progress: float = 0.0) -> dict:
    return {"loss_scale": 1.0, "progress": progress, "reference": backend.reference}


# ---- the KL-control layer -------------------------------------------------------------------


def test_step_kl_is_the_mean_reduced_gaussian_kl():
    means = torch.zeros(2, 2, 1, 2, 2)
    other = torch.zeros(2, 2, 1, 2, 2)
    other[0, 1, 0, 0, 0] = 2.0  # one element of sample 0, step 1 differs by 2
    scale = torch.tensor([1.0, 0.5])
    kl = step_kl(means, other, scale)
    # mean over 4 elements of (0,0,0,4) = 1, over 2 * 0.5^2 = 0.5 -> 2
    torch.testing.assert_close(kl, torch.tensor([[0.0, 2.0], [0.0, 0.0]]))
    # the closed form is KL(N(a, s^2) || N(b, s^2)) per element, averaged: check one by sampling-free formula
    a, b, s = 0.3, -0.2, 0.7
    exact = math.log(s / s) + (s**2 + (a - b) ** 2) / (2 * s**2) - 0.5
    got = step_kl(torch.full((1, 1, 1), a), torch.full((1, 1, 1), b), torch.tensor([s]))
    assert float(got) == pytest.approx(exact)


@pytest.mark.parametrize("sde", ["flow", "dance", "cps"])
def test_transition_std_matches_each_sdes_closed_form(sde):
    stage = SD3Stage(tiny_model_config().build(), sde=sde)
    sigmas = torch.tensor([1.0, 0.8, 0.5, 0.2, 0.0])
    seg = type("Seg", (), {"sigmas": sigmas, "eta": 0.7})()
    got = transition_std(stage, seg, [0, 1, 2])
    dt = -(sigmas[1:4] - sigmas[0:3])
    if sde == "flow":  # std_dev_t = sqrt(sigma / (1 - s)) eta, s = sigmas[1] at sigma = 1
        s = torch.tensor([0.8, 0.8, 0.5])
        want = torch.sqrt(sigmas[:3] / (1 - s)) * 0.7 * torch.sqrt(dt)
    elif sde == "dance":
        want = 0.7 * torch.sqrt(dt)
    else:
        want = sigmas[1:4] * math.sin(0.7 * math.pi / 2)
    torch.testing.assert_close(got, want)


def test_kl_controller_fixed_keeps_beta_and_adaptive_follows_ziegler():
    fixed = KLController(0.1)
    assert not fixed.adaptive and fixed.update(5.0, 1000) == 0.1
    c = KLController(0.1, target=0.01, horizon=100)
    # KL 3x the target: the proportional error 2 is clipped to 0.2
    assert c.update(0.03, 32) == pytest.approx(0.1 * (1 + 0.2 * 32 / 100))
    b = c.value
    # KL 10% over: error 0.1
    assert c.update(0.011, 50) == pytest.approx(b * (1 + 0.1 * 50 / 100))
    b = c.value
    # KL 0: error -1 clipped to -0.2
    assert c.update(0.0, 100) == pytest.approx(b * 0.8)
    c2 = KLController(1.0, target=1.0, horizon=10)
    c2.load_state_dict(c.state_dict())
    assert c2.value == c.value


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"beta": -0.1}, "beta must be >= 0"),
        ({"beta": 0.0, "target": 0.01}, "set beta > 0 as its initial value"),
        ({"beta": 0.1, "target": -1.0}, "kl_target must be > 0 or null"),
        ({"beta": 0.1, "target": 0.1, "horizon": 0}, "kl_horizon must be >= 1"),
    ],
)
def test_kl_controller_errors_name_the_key(kwargs, message):
    with pytest.raises(ValueError, match=message):
        KLController(**kwargs)
    with pytest.raises(ValueError, match=message):
        FlowGRPOConfig(
            beta=kwargs["beta"], kl_target=kwargs.get("target"), kl_horizon=kwargs.get("horizon", 10000)
        )


# ---- Flow-GRPO on the shared layer ----------------------------------------------------------


def test_flow_grpo_loss_and_gradient_with_kl_match_the_formula():
    """L = mean_{i,t} max(-A r, -A clip(r)) + beta mean_{i,t} mean((mu - mu_ref)^2) / (2 std_dev_t^2)."""
    algo = FlowGRPO(FlowGRPOConfig(clip_range=0.05, beta=0.3, old_logp_source="rollout"))
    stage, backend, _, sp = make_setup(algo)
    track = scored_track(stage, sp)
    perturb(backend)  # policy != reference and != pi_old: ratios and KL both move
    backend.zero_grad()
    metrics = algo.compute_loss_and_backward(stage, track, ctx_of(backend))
    got = grads(backend)

    backend.zero_grad()
    logp, mu, std_dev_t, ref = direct_replay(stage, backend, track, with_reference=True)
    r = torch.exp(logp - track.segment.log_probs)
    a = track.advantages[:, None]
    policy = torch.maximum(-a * r, -a * r.clamp(0.95, 1.05)).mean()
    kl = ((mu - ref) ** 2).flatten(2).mean(-1) / (2 * std_dev_t[None, :] ** 2)
    loss = policy + 0.3 * kl.mean()
    loss.backward()
    for g, w in zip(got, grads(backend), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-8)
    assert metrics["loss"] == pytest.approx(float(loss.detach()), abs=1e-7)  # a sum of cancelling terms
    assert metrics["kl"] == pytest.approx(float(kl.detach().mean()), rel=1e-5)
    assert metrics["kl/coef"] == 0.3


def test_adaptive_coefficient_steps_once_per_rollout_and_resumes(tmp_path):
    algo = FlowGRPO(FlowGRPOConfig(clip_range=0.2, beta=0.1, kl_target=1e-6, kl_horizon=64))
    stage, backend, stack, sp = make_setup(algo, micro=4)
    first = stack.train_track(scored_track(stage, sp), progress=0.0)
    # LoRA is the identity on the first update: KL 0, error -1 clipped to -0.2, over the 8 samples
    assert first["kl"] == 0.0 and first["kl/coef"] == 0.1
    assert first["kl/coef_next"] == pytest.approx(0.1 * (1 - 0.2 * 8 / 64))
    second = stack.train_track(scored_track(stage, sp, rollout_id=1), progress=0.1)
    assert second["kl/coef"] == first["kl/coef_next"]
    error = min(max(second["kl"] / 1e-6 - 1, -0.2), 0.2)
    assert second["kl/coef_next"] == pytest.approx(second["kl/coef"] * (1 + error * 8 / 64))

    save_train_state(str(tmp_path), backend, rank=0, algorithm=algo)
    resumed = FlowGRPO(FlowGRPOConfig(clip_range=0.2, beta=0.1, kl_target=1e-6, kl_horizon=64))
    fresh = TrainBackend(
        tiny_model_config().build().transformer, LoRAConfig(rank=4, alpha=8), OptimConfig(), 10
    )
    load_train_state(str(tmp_path), fresh, rank=0, algorithm=resumed)
    assert resumed.kl.value == algo.kl.value == second["kl/coef_next"]


# ---- DDPO -----------------------------------------------------------------------------------


def test_ddpo_clips_advantages_then_the_ratio():
    algo = DDPO(DDPOConfig(clip_range=0.2, adv_clip_max=5.0))
    stage, backend, _, sp = make_setup(algo)
    track = scored_track(stage, sp)
    track.advantages = torch.tensor([7.0, -9.0, 1.0, -1.0, 2.0, 0.5, -0.5, 3.0])
    perturb(backend)
    backend.zero_grad()
    metrics = algo.compute_loss_and_backward(stage, track, ctx_of(backend))
    got = grads(backend)
    backend.zero_grad()
    logp, _, _, _ = direct_replay(stage, backend, track, with_reference=False)
    r = torch.exp(logp - track.segment.log_probs)
    a = track.advantages.clamp(-5, 5)[:, None]
    loss = torch.maximum(-a * r, -a * r.clamp(0.8, 1.2)).mean()
    loss.backward()
    for g, w in zip(got, grads(backend), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-8)
    assert metrics["ddpo/adv_clipped_frac"] == 0.25
    assert not algo.needs_reference_policy and DDPOConfig().clip_range == 1e-4


def test_ddpo_first_update_ratio_is_exactly_one_with_replayed_pi_old():
    algo = DDPO(DDPOConfig(old_logp_source="replay"))
    stage, _, stack, sp = make_setup(algo, updates=2)
    metrics = stack.train_track(scored_track(stage, sp), progress=0.0)
    assert metrics["ratio/first_update_mean"] == 1.0


# ---- DPOK -----------------------------------------------------------------------------------


def test_dpok_policy_loss_against_hand_computation():
    new = torch.tensor([[math.log(1.5), math.log(1.00005)]])
    old = torch.zeros(1, 2)
    loss, ratio = dpok_policy_loss(new, old, torch.tensor([2.0]), alpha=10.0, eps=1e-4)
    # clamp(1.5) = 1.0001 ; 1.00005 stays: -10 * 2 * r
    torch.testing.assert_close(loss, torch.tensor([[-20 * 1.0001, -20 * 1.00005]]))
    torch.testing.assert_close(ratio, torch.tensor([[1.5, 1.00005]]))


def test_dpok_loss_and_gradient_match_the_formula():
    """L = mean -alpha A clamp(r) + beta mean((mu - mu_ref)^2) / (2 std^2), std the transition std."""
    algo = DPOK(DPOKConfig(beta=0.2, reward_weight=3.0, ratio_clip=0.05))
    stage, backend, _, sp = make_setup(algo)
    assert algo.needs_reference_policy
    track = scored_track(stage, sp)
    perturb(backend)
    backend.zero_grad()
    metrics = algo.compute_loss_and_backward(stage, track, ctx_of(backend))
    got = grads(backend)
    backend.zero_grad()
    logp, mu, std_dev_t, ref = direct_replay(stage, backend, track, with_reference=True)
    sig = track.segment.sigmas
    idx = torch.tensor(track.segment.sde_indices)
    std = std_dev_t * torch.sqrt(sig[idx] - sig[idx + 1])  # the Flow SDE's transition std
    r = torch.exp(logp - track.segment.log_probs)
    policy = (-3.0 * track.advantages[:, None] * r.clamp(0.95, 1.05)).mean()
    kl = ((mu - ref) ** 2).flatten(2).mean(-1) / (2 * std[None, :] ** 2)
    (policy + 0.2 * kl.mean()).backward()
    for g, w in zip(got, grads(backend), strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-8)
    assert metrics["kl"] == pytest.approx(float(kl.detach().mean()), rel=1e-5)


def test_dpok_without_a_reference_is_refused():
    with pytest.raises(ValueError, match="beta must be > 0 for DPOK"):
        DPOKConfig(beta=0.0)


def test_dpok_full_finetune_regularises_toward_the_frozen_copy():
    algo = DPOK(DPOKConfig(beta=0.1, old_logp_source="replay"))
    stage, backend, stack, sp = make_setup(algo, lora=False)
    first = stack.train_track(scored_track(stage, sp), progress=0.0)
    assert first["kl"] == 0.0 and first["ratio/first_update_mean"] == 1.0
    second = stack.train_track(scored_track(stage, sp, rollout_id=1), progress=0.1)
    assert second["kl"] > 0.0


# ---- Flow-DPPO ------------------------------------------------------------------------------


def test_dppo_mask_drops_only_far_steps_moving_with_their_advantage():
    # columns: (ratio, advantage, divergence) combinations
    ratio = torch.tensor([[1.5, 1.5, 0.5, 0.5, 1.5, 0.5]])
    adv = torch.tensor([2.0])
    div = torch.tensor([[1e-3, 1e-7, 1e-3, 1e-3, 1e-3, 1e-3]])
    loss, r, drop = dppo_policy_loss(ratio.log(), torch.zeros_like(ratio), adv, div, tau=1e-5)
    # A > 0: r > 1 and far -> dropped; r > 1 but near -> kept; r < 1 (corrective) -> kept
    assert drop.tolist() == [[True, False, False, False, True, False]]
    torch.testing.assert_close(loss, torch.where(drop, torch.zeros_like(r), -2.0 * r))
    _, _, drop_neg = dppo_policy_loss(ratio.log(), torch.zeros_like(ratio), -adv, div, tau=1e-5)
    # A < 0: dropped where r < 1 and far
    assert drop_neg.tolist() == [[False, False, True, True, False, True]]
    # a dropped step with an overflowing ratio gives 0, not nan
    big, _, _ = dppo_policy_loss(torch.tensor([[200.0]]), torch.zeros(1, 1), adv, torch.ones(1, 1), 1e-5)
    assert big.item() == 0.0


def test_flow_dppo_loss_and_gradient_match_the_formula():
    algo = FlowDPPO(FlowDPPOConfig())
    stage, backend, _, sp = make_setup(algo)
    track = algo.prepare_segment(stage, scored_track(stage, sp))  # mu_old under the sampling weights
    old_means = track.conditions[OLD_MEANS_KEY].clone()
    perturb(backend, scale=0.02)
    seg = track.segment
    logp, mu, std_dev_t, _ = direct_replay(stage, backend, track, with_reference=False)
    idx = torch.tensor(seg.sde_indices)
    std = std_dev_t * torch.sqrt(seg.sigmas[idx] - seg.sigmas[idx + 1])
    d = ((mu.detach() - old_means) ** 2).flatten(2).mean(-1) / (2 * std[None, :] ** 2)
    algo.config.kl_threshold = tau = float(d.median())  # about half the steps are far
    r = torch.exp(logp - seg.log_probs)
    a = track.advantages[:, None]
    drop = (d >= tau) & (((r > 1) & (a > 0)) | ((r < 1) & (a < 0)))
    assert 0 < int(drop.sum()) < drop.numel()  # the case exercises both branches
    backend.zero_grad()
    (-a * r * (~drop)).mean().backward()
    want = grads(backend)

    backend.zero_grad()
    metrics = algo.compute_loss_and_backward(stage, track, ctx_of(backend))
    for g, w in zip(grads(backend), want, strict=True):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-8)
    assert metrics["dppo/masked_frac"] == pytest.approx(float(drop.float().mean()))
    assert metrics["dppo/kl_old"] == pytest.approx(float(d.mean()), rel=1e-4)


def test_flow_dppo_first_update_is_on_policy_and_old_means_stay_frozen():
    algo = FlowDPPO(FlowDPPOConfig(kl_threshold=1e-9, old_logp_source="replay"))
    stage, _, stack, sp = make_setup(algo, micro=4, updates=3)
    track = scored_track(stage, sp)
    micro, ctx = stack.prepare(track, progress=0.0)
    frozen = [mb.conditions[OLD_MEANS_KEY].clone() for mb in micro]
    rows = stack.backward(micro, ctx)
    assert all(
        r["ratio/mean"] == 1.0 and r["dppo/kl_old"] == 0.0 and r["dppo/masked_frac"] == 0.0 for r in rows
    )
    stack.backend.optimizer_step()
    rows = stack.backward(micro, ctx)  # weights moved: far from pi_old, some steps masked
    assert all(torch.equal(mb.conditions[OLD_MEANS_KEY], f) for mb, f in zip(micro, frozen, strict=True))
    assert max(r["dppo/kl_old"] for r in rows) > 1e-9
    assert sum(r["dppo/masked_frac"] for r in rows) > 0


def test_step_losses_need_sde_steps():
    for algo in (DDPO(), DPOK(), FlowDPPO()):
        stage, _, stack, sp = make_setup(algo)
        sp.eta = 0.0
        with pytest.raises(ValueError, match=f"no SDE steps .*{type(algo).__name__} needs log-probs"):
            stack.train_track(scored_track(stage, sp), progress=0.0)
