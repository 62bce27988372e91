"""A Janus backbone under FSDP2 on 2 gloo ranks, sharded as the unified worker shards it (the decoder
layers and each submodule a stage calls, `JanusBundle.fsdp_roots`, as roots of their own): the plans
(rank 0's stop after one token, rank 1's run on: the ranks still run the same forwards), the guided
image tokens and both segments' replayed log-probs equal the unsharded model's, and the gradient
every rank holds is the mean of the unsharded per-rank gradients."""

from __future__ import annotations

import contextlib
import queue as queue_module
import time

import torch

from tests.gloo import join_gloo, rank_context

TINY = {"hidden_size": 32, "num_layers": 2, "max_position_embeddings": 128, "seed": 3}
CANDIDATES = [
    "a red circle", "three blue squares", "one green triangle", "two big stars", "left of it", "x", "draw me",
    "purple", "a scene", "yes",
]  # fmt: skip
NEW = 6


def _plan_request(prompt: str, stops: list[str]):
    from unirl.types import PromptExample, RolloutReq, TextSamplingParams

    sampling = TextSamplingParams(
        samples_per_prompt=1, max_new_tokens=NEW, temperature=0.0, stop_tokens=stops, chat_template=False, seed=1
    )
    return RolloutReq.from_prompts([PromptExample(prompt, prompt)], sampling, None, rollout_id=0)


def _segments(bundle, module, req):
    """(plan segment, image segment) of `req` under `module`: a greedy plan, then guided image tokens."""
    from unirl.models.causal_lm import CausalLMStage
    from unirl.models.image_tokens import VQImageStage
    from unirl.types import ImageTokenSamplingParams

    plan_stage, image_stage = CausalLMStage(bundle), VQImageStage(bundle)
    plan_stage.module = image_stage.module = module
    plan, _ = plan_stage.generate(req)
    contexts = [image_stage.image_context(p, r) for p, r in zip(plan.prompt_ids, plan.response_ids, strict=True)]
    image, _ = image_stage.generate(contexts, [7], ImageTokenSamplingParams(guidance_scale=3.0, seed=7))
    return plan_stage, image_stage, plan, image


def _loss(plan_stage, image_stage, plan, image) -> torch.Tensor:
    return -(plan_stage.token_log_probs(plan).sum() + image_stage.token_log_probs(image).mean())


def _rank(rank: int, world: int, rdzv: str, queue) -> None:
    import torch.distributed as dist

    from unirl.models.janus import JanusModelConfig
    from unirl.train.backend import OptimConfig, TrainBackend
    from unirl.train.fsdp import FSDPConfig

    torch.set_num_threads(1)
    join_gloo(rank, world, rdzv)
    try:
        ref = JanusModelConfig(tiny=TINY).build()
        tok = ref.tokenizer
        # rank 0's prompt stops at its first greedy token (one that is a stop token alone); rank 1's
        # is one whose greedy plan never says it
        plans = {p: _segments(ref, ref.model, _plan_request(p, []))[2].response_ids[0].tolist() for p in CANDIDATES}
        first = next(
            p for p in CANDIDATES if len(tok.encode(tok.decode(plans[p][:1]), add_special_tokens=False)) == 1
        )
        stop_id = plans[first][0]
        other = next(p for p in CANDIDATES if stop_id not in plans[p])
        requests = [_plan_request(p, [tok.decode([stop_id])]) for p in (first, other)]
        grads = []
        for req in requests:  # the unsharded gradient of each rank's loss
            ref.model.zero_grad()
            parts = _segments(ref, ref.model, req)
            _loss(*parts).backward()
            grads.append({n: p.grad.clone() for n, p in ref.model.named_parameters() if p.grad is not None})
        want = _segments(ref, ref.model, requests[rank])

        bundle = JanusModelConfig(tiny=TINY).build()
        backend = TrainBackend(
            bundle.model,
            None,
            OptimConfig(lr=1e-3),
            10,
            fsdp=FSDPConfig(block_classes=["LlamaDecoderLayer"]),
            frozen=bundle.frozen_modules,
            roots=bundle.fsdp_roots,
        )
        got = _segments(bundle, backend.module, requests[rank])
        out = {
            "plan_len": int(got[2].response_ids[0].numel()),
            "plan_equal": torch.equal(got[2].response_ids[0], want[2].response_ids[0]),
            "image_equal": torch.equal(got[3].response_ids[0], want[3].response_ids[0]),
            "plan_lp": float((got[0].token_log_probs(got[2]) - want[0].token_log_probs(want[2])).abs().max()),
            "image_lp": float((got[1].token_log_probs(got[3]) - want[1].token_log_probs(want[3])).abs().max()),
        }
        _loss(*got).backward()
        worst, checked = 0.0, 0
        for name, param in backend.named_params:
            key = name.removeprefix("_fsdp_wrapped_module.")
            mean = (grads[0][key] + grads[1][key]) / 2 if key in grads[0] else torch.zeros_like(param)
            grad = param.grad.full_tensor() if param.grad is not None else torch.zeros_like(mean)
            worst = max(worst, float((grad - mean).abs().max()) / (float(mean.abs().max()) + 1e-12))
            checked += 1
        out.update(grad_rel=worst, checked=checked, trainable=len(backend.params))
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_sharded_janus_samples_replays_and_reduces_as_the_unsharded_model(tmp_path):
    world, rdzv = 2, str(tmp_path)
    ctx = rank_context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, rdzv, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results, deadline = {}, time.monotonic() + 300
    try:
        while len(results) < world and time.monotonic() < deadline:
            if any(p.exitcode not in (None, 0) for p in procs):
                break  # a rank failed (its traceback is in the output): its peer waits in a collective
            with contextlib.suppress(queue_module.Empty):
                rank, out = queue.get(timeout=2)
                results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=30 if len(results) == world else 0.1)
            if p.is_alive():
                p.terminate()
    assert len(results) == world and all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    assert results[0]["plan_len"] == 1 and results[1]["plan_len"] > 1  # the ranks' plans end apart
    for out in results.values():
        assert out["plan_equal"] and out["image_equal"]
        assert out["plan_lp"] <= 1e-5 and out["image_lp"] <= 1e-5
        assert out["checked"] == out["trainable"] > 0
        assert out["grad_rel"] <= 1e-5, out["grad_rel"]
