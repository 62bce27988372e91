"""`rollout.keep_graph`: the on-policy loss backpropagates through graphs kept from sampling.

The kept path must give the replay path's loss, metrics and gradients (to float
rounding: the sampling forward and the replay forward batch differently), the
ratio exactly 1, within a budget of kept pairs with the rest replayed; and the
graphs must never outlive their step. No Ray.
"""

from __future__ import annotations

import math

import pytest
import torch

from tests.conftest import tiny_model_config
from unirl.algorithms.advantages import track_advantages
from unirl.algorithms.ddpo import DDPO, DDPOConfig
from unirl.algorithms.diffusion_nft import DiffusionNFT
from unirl.algorithms.dpok import DPOK, DPOKConfig
from unirl.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
from unirl.models.sd3 import SD3Stage
from unirl.rollout.kept import KeptGraphs
from unirl.rollout.trainside import TrainsideEngine
from unirl.sde.schedules import sigmas_for
from unirl.sde.strategies import StepOutput
from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend
from unirl.train.fsdp import FSDPConfig
from unirl.train.stack import TrainStack, TrainStackConfig, keep_graph_problems
from unirl.types import AdvantageConfig, DiffusionSamplingParams, PromptExample, RolloutReq

PROMPTS = [PromptExample("a red square", "0"), PromptExample("a blue dot", "1")]


def setup(
    algo: FlowGRPOConfig | None = None,
    cls: type[FlowGRPO] = FlowGRPO,
    guidance: float = 2.0,
    detach_uncond: bool = True,
    lora_dropout: float = 0.0,
    autocast: str | None = None,
    checkpointing: bool = False,
    lora: bool = True,
):
    algo = algo or FlowGRPOConfig(clip_range=0.2)
    bundle = tiny_model_config().build()
    stage = SD3Stage(bundle, replay_steps_per_forward=2, detach_uncond=detach_uncond, autocast_dtype=autocast)
    backend = TrainBackend(
        stage.module,
        LoRAConfig(rank=4, alpha=8, dropout=lora_dropout) if lora else None,
        OptimConfig(lr=1e-2, weight_decay=0.0),
        10,
        fsdp=FSDPConfig(activation_checkpointing=True) if checkpointing else None,
        keep_reference=algo.beta > 0,
    )
    stage.module = backend.module
    stack = TrainStack(stage, backend, cls(algo), TrainStackConfig(micro_batch_size=4))
    sp = DiffusionSamplingParams(
        num_steps=4,
        samples_per_prompt=4,
        height=16,
        width=16,
        guidance_scale=guidance,
        eta=0.7,
        max_sequence_length=8,
        sde_scheduler="all",
    )
    return stage, backend, stack, sp


def request(stage, sp, rollout_id: int = 0) -> RolloutReq:
    sigmas = sigmas_for(sp, stage.bundle.image_seq_len(sp.height, sp.width))
    return RolloutReq.from_prompts(PROMPTS, sp, sigmas, rollout_id)


def kept_rollout(stage, sp, max_pairs: int | None = None, forward_batch_size: int = 3):
    """A scored track whose SDE steps' graphs are kept; (track, engine)."""
    engine = TrainsideEngine(
        stage, forward_batch_size=forward_batch_size, keep_graph=True, keep_graph_max_pairs=max_pairs
    )
    track = engine.generate(request(stage, sp), keep=True).track("diffusion")
    track.rewards = track.media.float().mean(dim=(1, 2, 3))
    track_advantages(track, AdvantageConfig())
    return track, engine


def gradients(stack, backend, track, kept=None) -> tuple[list[torch.Tensor], list[dict[str, float]]]:
    """One update's accumulated gradients (no optimizer step) and its metric rows."""
    micro, ctx = stack.prepare(track, 0.0, kept)
    backend.zero_grad()
    rows = stack.backward(micro, ctx)
    return [p.grad.detach().clone() for p in backend.params], rows


def assert_grads_close(got, want, rel: float = 1e-4) -> None:
    scale = max(float(w.abs().max()) for w in want)
    assert scale > 0
    worst = max(float((g - w).abs().max()) for g, w in zip(got, want, strict=True))
    assert worst <= rel * scale, f"max |grad difference| {worst:.3g} vs max |grad| {scale:.3g}"


@pytest.mark.parametrize(
    "kind",
    [
        "cfg_detached",
        "no_cfg",
        "cfg_through_uncond",
        "kl_reference",
        "replayed_pi_old",
        "checkpointing",
        "ddpo",
        "dpok",
        "full_finetune",
    ],
)
def test_kept_graph_gives_the_replay_loss_metrics_and_gradients(kind):
    kwargs = {
        "no_cfg": {"guidance": 1.0},
        "cfg_through_uncond": {"detach_uncond": False},
        "kl_reference": {"algo": FlowGRPOConfig(clip_range=0.2, beta=0.05)},
        "replayed_pi_old": {"algo": FlowGRPOConfig(clip_range=0.2, old_logp_source="replay")},
        "checkpointing": {"checkpointing": True},
        # step losses Flow-GRPO drives: DDPO's clip and advantage clip, DPOK's exact KL to the reference
        "ddpo": {"cls": DDPO, "algo": DDPOConfig(adv_clip_max=0.5)},
        "dpok": {"cls": DPOK, "algo": DPOKConfig(beta=0.05)},
        "full_finetune": {"lora": False},
    }.get(kind, {})
    stage, backend, stack, sp = setup(**kwargs)
    track, engine = kept_rollout(stage, sp)
    assert len(engine.kept) == len(track) * len(track.segment.sde_indices)
    want, replay_rows = gradients(stack, backend, track)
    got, kept_rows = gradients(stack, backend, track, engine.kept)
    assert_grads_close(got, want)
    for replayed, kept in zip(replay_rows, kept_rows, strict=True):
        assert kept.pop("keep_graph/kept_fraction") == 1.0
        assert sorted(kept) == sorted(replayed)
        for key, value in replayed.items():
            assert kept[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
        # the kept graph is the forward pi_old came from: the ratio is exactly 1
        assert kept["ratio/min"] == kept["ratio/max"] == 1.0


def test_kept_gradient_is_the_policy_gradient_written_out():
    """With ratio 1 and no clipping, the loss gradient is -mean_{i,t} A_i grad log p_it:
    computed here in one full-batch replay of every SDE step, apart from the stack."""
    stage, backend, stack, sp = setup()
    track, engine = kept_rollout(stage, sp)
    got, _ = gradients(stack, backend, track, engine.kept)
    backend.zero_grad()
    stage.module.train()
    seg = track.segment
    logp, _, _ = stage.replay(seg, track.conditions, seg.sde_indices)
    (-(track.advantages.unsqueeze(1) * logp).mean()).backward()
    assert_grads_close(got, [p.grad for p in backend.params])


def test_budget_keeps_whole_forwards_and_replays_the_rest():
    stage, backend, stack, sp = setup()
    # 8 samples in forwards of 3, 3, 2 over 4 SDE steps; 13 pairs fit the 3-sample forwards of
    # steps 0..3 of the first chunk (12), nothing more (the next forward is 3 again)
    track, engine = kept_rollout(stage, sp, max_pairs=13)
    assert len(engine.kept) == 12
    assert engine.kept.covers(track.sample_ids[:3], track.segment.sde_indices)
    assert not engine.kept.covers(track.sample_ids[3:4], track.segment.sde_indices[:1])
    want, _ = gradients(stack, backend, track)
    # micro-batches of 4: none is fully kept, so everything is replayed
    got, rows = gradients(stack, backend, track, engine.kept)
    assert [r["keep_graph/kept_fraction"] for r in rows] == [0.0, 0.0]
    assert_grads_close(got, want)
    # a budget that covers the first micro-batch (samples 0..3 sit in forwards 0..2 and 3..5)
    stage2, backend2, stack2, sp2 = setup()
    track2, engine2 = kept_rollout(stage2, sp2, max_pairs=24, forward_batch_size=2)
    assert len(engine2.kept) == 24  # forwards of 2: samples 0..5 at every step
    want2, _ = gradients(stack2, backend2, track2)
    got2, rows2 = gradients(stack2, backend2, track2, engine2.kept)
    assert [r["keep_graph/kept_fraction"] for r in rows2] == [1.0, 0.0]
    assert_grads_close(got2, want2)


def test_keeping_samples_the_same_trajectories_and_log_probs():
    stage, _, _, sp = setup()
    plain = TrainsideEngine(stage, forward_batch_size=3).generate(request(stage, sp)).track("diffusion")
    kept, _ = kept_rollout(stage, sp)
    # the kept steps run the CFG halves in two forwards instead of one: equal to float rounding
    torch.testing.assert_close(kept.segment.latents, plain.segment.latents, rtol=0, atol=1e-5)
    torch.testing.assert_close(kept.segment.log_probs, plain.segment.log_probs, rtol=0, atol=1e-5)
    assert not kept.segment.log_probs.requires_grad and not kept.segment.latents.requires_grad


def test_sd3_transformer_is_the_same_function_in_eval_and_train_mode():
    """Sampling runs in eval mode and the loss in train mode: for the kept graph to be the
    trained function the two must agree (the SD3 transformer's only mode-dependent modules
    are dropouts, all p = 0)."""
    stage, _, _, sp = setup()
    seg_req = request(stage, sp)
    cond = stage.encode_prompts(seg_req.prompts, 2.0, 8)
    x = torch.randn(
        len(seg_req), *stage.bundle.latent_shape(16, 16), generator=torch.Generator().manual_seed(0)
    )
    sigma = torch.full((len(seg_req),), 0.6)
    with torch.no_grad():
        stage.module.eval()
        v_eval = stage.velocity(x, sigma, cond, 2.0)
        stage.module.train()
        v_train = stage.velocity(x, sigma, cond, 2.0)
    assert torch.equal(v_eval, v_train)


def test_bf16_autocast_kept_gradients_match_replay():
    stage, backend, stack, sp = setup(autocast="bfloat16")
    track, engine = kept_rollout(stage, sp)
    want, _ = gradients(stack, backend, track)
    got, rows = gradients(stack, backend, track, engine.kept)
    assert all(r["ratio/min"] == r["ratio/max"] == 1.0 for r in rows)
    # bf16 forwards of different batch layouts round differently: a looser, still tight bound
    cos = torch.nn.functional.cosine_similarity(
        torch.cat([g.flatten() for g in got]), torch.cat([w.flatten() for w in want]), dim=0
    )
    assert float(cos) > 0.99


def test_kept_store_lookup_and_errors():
    kept = KeptGraphs(max_pairs=4)
    w = torch.ones(3, requires_grad=True)
    lp = w * torch.tensor([1.0, 2.0, 3.0])
    mean = (w * 2).view(3, 1, 1, 1).expand(3, 2, 1, 1)
    kept.add(5, ["a", "b", "c"], StepOutput(mean, mean, torch.tensor(0.5), lp))
    assert kept.room(1) and not kept.room(2)
    with pytest.raises(ValueError, match="already kept"):
        kept.add(5, ["a"], StepOutput(mean[:1], mean[:1], torch.tensor(0.5), lp[:1]))
    with pytest.raises(ValueError, match="keep_graph_max_pairs=4"):
        kept.add(6, ["a", "b"], StepOutput(mean[:2], mean[:2], torch.tensor(0.5), lp[:2]))
    assert kept.lookup(["a"], [6]) is None
    logp, means, std = kept.lookup(["c", "a"], [5])
    assert logp.shape == (2, 1) and means.shape == (2, 1, 2, 1, 1) and std.tolist() == [0.5]
    assert logp[:, 0].tolist() == [3.0, 1.0]
    logp.sum().backward()  # the graph reaches the weights through the lookup
    assert w.grad.tolist() == [1.0, 0.0, 3.0]
    kept.clear()
    assert len(kept) == 0 and kept.lookup(["a"], [5]) is None
    with pytest.raises(ValueError, match="keep_graph_max_pairs must be >= 1"):
        KeptGraphs(0)


def test_engine_refuses_active_dropout():
    stage, _, _, _ = setup(lora_dropout=0.1)
    with pytest.raises(ValueError, match="active dropout.*train.lora.dropout=0"):
        TrainsideEngine(stage, keep_graph=True)
    TrainsideEngine(stage)  # without keep_graph dropout is fine


def test_keep_graph_problems_name_each_conflict():
    flow = FlowGRPO(FlowGRPOConfig())
    assert keep_graph_problems(flow, 1, full_finetune=False) == []
    assert keep_graph_problems(flow, 1, full_finetune=True) == []  # no reference: nothing swaps weights
    (multi,) = keep_graph_problems(flow, 2, full_finetune=False)
    assert "num_updates_per_batch=2" in multi
    (swap,) = keep_graph_problems(FlowGRPO(FlowGRPOConfig(beta=0.1)), 1, full_finetune=True)
    assert "train.lora: null" in swap
    nft = keep_graph_problems(DiffusionNFT(), 1, full_finetune=False)
    assert any("DiffusionNFT cannot train from graphs kept" in p for p in nft)

    class EMARollouts(FlowGRPO):
        requires_ema_rollout = True

    (ema,) = keep_graph_problems(EMARollouts(FlowGRPOConfig()), 1, full_finetune=False)
    assert "samples from the EMA weights" in ema


def test_stack_refuses_kept_graphs_for_several_updates():
    stage, backend, _, _ = setup()
    stack = TrainStack(
        stage, backend, FlowGRPO(FlowGRPOConfig()), TrainStackConfig(4, num_updates_per_batch=2)
    )
    kept = KeptGraphs()
    kept.add(0, ["s"], StepOutput(torch.zeros(1, 1), torch.zeros(1, 1), torch.tensor(1.0), torch.zeros(1)))
    with pytest.raises(ValueError, match="num_updates_per_batch=2"):
        stack.train_track(None, 0.0, kept=kept)  # refused before the track is read


def test_train_track_with_kept_graphs_steps_like_replay():
    """A whole update (clip, AdamW step) from kept graphs moves the weights as replay does; a
    weight change between sampling and the kept backward is an error, not a wrong gradient."""
    stage, backend, stack, sp = setup()
    track, engine = kept_rollout(stage, sp)
    start = [p.detach().clone() for p in backend.params]
    kept = stack.train_track(track, 0.0, kept=engine.kept)
    after_kept = [p.detach().clone() for p in backend.params]
    with torch.no_grad():
        for p, s in zip(backend.params, start, strict=True):
            p.copy_(s)
    backend.optimizer.state.clear()
    replay = stack.train_track(track, 0.0)
    assert kept["train/grad_norm"] == pytest.approx(replay["train/grad_norm"], rel=1e-4)
    assert kept["ratio/first_update_mean"] == 1.0 and kept["keep_graph/kept_fraction"] == 1.0
    for p, want in zip(backend.params, after_kept, strict=True):
        # Adam normalises each gradient element: a 1e-4 relative difference can move a tiny one
        # by up to ~1e-3 of the lr (1e-2)
        torch.testing.assert_close(p.detach(), want, rtol=0, atol=1e-5)
    assert math.isfinite(kept["loss"])
    # the weights moved since `engine.kept`'s sampling: autograd refuses its graphs
    stale, stale_engine = kept_rollout(stage, sp)
    stack.train_track(stale, 0.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        stack.train_track(stale, 0.0, kept=stale_engine.kept)
