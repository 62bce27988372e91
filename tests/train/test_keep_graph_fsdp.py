"""`rollout.keep_graph` under FSDP2 on 2 gloo ranks: sampling forwards with autograd on a
sharded module, a backward a train call later, the gradients of the replay path; ranks whose
shards are laid out differently from their kept graphs replay together instead of running
different collectives. (Every rank samples with autograd alike: its shard has the same size.)"""

from __future__ import annotations

import torch

from tests.conftest import tiny_model_config
from tests.gloo import join_gloo, rank_context

CASES = {  # name: (FSDPConfig kwargs, keep_graph_max_pairs, rollout forward_batch_size)
    "reshard": ({"reshard_after_forward": True}, None, 4),
    # forwards of 2 samples, 10 pairs: micro-batch 0 kept, micro-batch 1 replayed
    "no_reshard_checkpointing_budget": (
        {"reshard_after_forward": False, "activation_checkpointing": True},
        10,
        2,
    ),
}


def _rank(rank: int, world: int, rdzv: str, queue) -> None:
    import torch.distributed as dist

    from unirl.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
    from unirl.models.sd3 import SD3Stage
    from unirl.rollout.trainside import TrainsideEngine
    from unirl.sde.schedules import sigmas_for
    from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend
    from unirl.train.fsdp import FSDPConfig
    from unirl.train.stack import TrainStack, TrainStackConfig
    from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

    torch.set_num_threads(1)
    join_gloo(rank, world, rdzv)
    try:
        out = {}
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
        for name, (fsdp, max_pairs, fbs) in [*CASES.items(), ("rank_1_reorders", ({}, None, 4))]:
            torch.manual_seed(0)
            bundle = tiny_model_config(num_layers=2).build()
            stage = SD3Stage(bundle, replay_steps_per_forward=2)
            backend = TrainBackend(
                stage.module, LoRAConfig(rank=4, alpha=8), OptimConfig(lr=1e-2), 10, fsdp=FSDPConfig(**fsdp)
            )
            stage.module = backend.module
            stack = TrainStack(stage, backend, FlowGRPO(FlowGRPOConfig(clip_range=0.2)), TrainStackConfig(2))
            sigmas = sigmas_for(sp, bundle.image_seq_len(sp.height, sp.width))
            prompts = [PromptExample("a red square", "0"), PromptExample("a blue dot", "1")]
            req = RolloutReq.from_prompts(prompts, sp, sigmas, 0).select(list(range(4 * rank, 4 * rank + 4)))
            engine = TrainsideEngine(
                stage, forward_batch_size=fbs, keep_graph=True, keep_graph_max_pairs=max_pairs
            )
            track = engine.generate(req, keep=True).track("diffusion")
            if name == "rank_1_reorders" and rank == 1:  # its shard no longer matches its rollout's layout
                track = track.select([1, 0, 3, 2])
            track.advantages = torch.linspace(-1.0, 1.0, 4) * (rank + 1)
            backend.zero_grad()
            micro, ctx = stack.prepare(track, 0.0)
            stack.backward(micro, ctx)
            replay = torch.cat([p.grad.full_tensor().flatten() for p in backend.params])
            # the whole update from the kept graphs (the ranks' layout check included); the
            # gradient is read just before the optimizer step
            seen, step = {}, backend.optimizer_step

            def recording_step(seen=seen, step=step, params=backend.params):
                seen["grad"] = torch.cat([p.grad.full_tensor().flatten() for p in params])
                return step()

            backend.optimizer_step = recording_step
            metrics = stack.train_track(track, 0.0, kept=engine.kept)
            out[name] = {
                "kept_pairs": len(engine.kept),
                "kept_fraction": metrics["keep_graph/kept_fraction"],
                "ratio_min": metrics["ratio/min"],
                "grad": seen["grad"].tolist(),  # plain lists: the queue outlives this process
                "replay_grad": replay.tolist(),
            }
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_kept_graphs_under_fsdp2_give_the_replay_gradients(tmp_path):
    world, rdzv = 2, str(tmp_path)
    ctx = rank_context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, world, rdzv, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    try:
        while len(results) < world:
            rank, out = queue.get(timeout=300)
            results[rank] = out
    finally:
        for p in procs:
            p.join(timeout=60)
    assert all(p.exitcode == 0 for p in procs)
    for name in [*CASES, "rank_1_reorders"]:
        for rank in range(world):
            got, want = (torch.tensor(results[rank][name][k]) for k in ("grad", "replay_grad"))
            assert float((got - want).abs().max()) <= 1e-4 * float(want.abs().max()), (name, rank)
        # the gradient is reduced over the ranks: both hold the same one
        assert results[0][name]["grad"] == results[1][name]["grad"], name
    assert [results[r]["reshard"]["kept_fraction"] for r in (0, 1)] == [1.0, 1.0]
    assert results[0]["reshard"]["ratio_min"] == 1.0
    budget = results[0]["no_reshard_checkpointing_budget"]
    assert budget["kept_pairs"] == 10 and budget["kept_fraction"] == 0.5
    # rank 1's shard is laid out differently: both ranks replay (the same collectives), nobody hangs
    assert [results[r]["rank_1_reorders"]["kept_fraction"] for r in (0, 1)] == [0.0, 0.0]
