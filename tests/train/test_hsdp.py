"""HSDP (`train.parallel.replicate`) on 4 gloo ranks: the 1 x 4 (FSDP), 2 x 2 (HSDP) and 4 x 1
(replicated) meshes give the single-process gradient of the whole batch, and a checkpoint written on
2 x 2 resumes on 1 x 4 and on 4 x 1 with the same weights and Adam moments, bit for bit, and the
same next gradient (issue 45, item 3)."""

from __future__ import annotations

import os

import torch

from tests.conftest import tiny_model_config
from tests.gloo import join_gloo, spawn_ranks

WORLD = 4
PER_RANK = 4
MESHES = (1, 2, 4)  # replicate: 1 x 4, 2 x 2, 4 x 1


def _setup(replicate: int | None, samples: list[int], offload: bool = False):
    """A tiny SD3 with LoRA under FSDP2 on the mesh (None: one process, unsharded), its train
    stack, and the Flow-GRPO track of `samples` (rollout 0) with fixed advantages."""
    from unirl.algorithms.flow_grpo import FlowGRPO, FlowGRPOConfig
    from unirl.models.sd3 import SD3Stage
    from unirl.rollout.trainside import TrainsideEngine
    from unirl.sde.schedules import sigmas_for
    from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend
    from unirl.train.fsdp import FSDPConfig, ParallelConfig
    from unirl.train.stack import TrainStack, TrainStackConfig
    from unirl.types import DiffusionSamplingParams, PromptExample, RolloutReq

    torch.manual_seed(0)
    bundle = tiny_model_config(num_layers=2).build()
    stage = SD3Stage(bundle, replay_steps_per_forward=2)
    fsdp = FSDPConfig(offload_params=offload) if replicate is not None else None
    backend = TrainBackend(
        stage.module,
        LoRAConfig(rank=4, alpha=8),
        OptimConfig(lr=1e-2),
        10,
        fsdp=fsdp,
        parallel=ParallelConfig(replicate=replicate or 1),
    )
    stage.module = backend.module
    stack = TrainStack(stage, backend, FlowGRPO(FlowGRPOConfig(clip_range=0.2)), TrainStackConfig(PER_RANK))
    sp = DiffusionSamplingParams(
        num_steps=4, samples_per_prompt=8, height=16, width=16, guidance_scale=2.0, eta=0.7,
        max_sequence_length=8, sde_scheduler="all",
    )  # fmt: skip
    sigmas = sigmas_for(sp, bundle.image_seq_len(sp.height, sp.width))
    prompts = [PromptExample("a red square", "0"), PromptExample("a blue dot", "1")]
    req = RolloutReq.from_prompts(prompts, sp, sigmas, 0).select(samples)
    track = TrainsideEngine(stage, forward_batch_size=4).generate(req).track("diffusion")
    track.advantages = torch.linspace(-1.0, 1.0, 16)[samples]
    return backend, stack, track


def _grad(backend, stack, track) -> torch.Tensor:
    """The accumulated gradient of one update over `track`, as one flat vector (full tensors)."""
    backend.zero_grad()
    micro, ctx = stack.prepare(track, 0.0)
    stack.backward(micro, ctx)
    return torch.cat([_full(p.grad).flatten() for p in backend.params])


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _state(backend) -> list[torch.Tensor]:
    """Every trainable parameter and both Adam moments, full."""
    out = [_full(p.detach()).clone() for p in backend.params]
    for p in backend.params:
        st = backend.optimizer.state[p]
        out += [_full(st["exp_avg"]).clone(), _full(st["exp_avg_sq"]).clone()]
    return out


def _rank(rank: int, rdzv: str, path: str, out_dir: str) -> None:
    import torch.distributed as dist

    from unirl.train.checkpoint import load_train_state, save_train_state

    torch.set_num_threads(1)
    join_gloo(rank, WORLD, rdzv)
    try:
        mine = list(range(PER_RANK * rank, PER_RANK * rank + PER_RANK))
        out = {}
        for replicate in MESHES:
            backend, stack, track = _setup(replicate, mine)
            out[f"mesh_{replicate}"] = tuple(backend.params[0].device_mesh.shape)
            out[f"grad_{replicate}"] = _grad(backend, stack, track).tolist()
        # train one step on 2 x 2, checkpoint, then the next gradient there and after resharding
        backend, stack, track = _setup(2, mine)
        stack.train_track(track, 0.0)
        save_train_state(path, backend, rank)
        saved = _state(backend)
        # FSDP2 parameter offload (CPUOffloadPolicy) on the same mesh: the same gradient and step
        offloaded, off_stack, _ = _setup(2, mine, offload=True)
        from torch.distributed.fsdp import FSDPModule

        groups = [
            g
            for m in offloaded.module.modules()
            if isinstance(m, FSDPModule)
            for g in m._get_fsdp_state()._fsdp_param_groups
        ]
        out["offload_policies"] = sorted({type(g.offload_policy).__name__ for g in groups})
        out["compute_device"] = str(offloaded.module.compute_device)
        out["grad_offload"] = _grad(offloaded, off_stack, track).tolist()
        off_stack.train_track(track, 0.0)
        out["offload_step_equal"] = all(
            torch.equal(a, b) for a, b in zip(saved, _state(offloaded), strict=True)
        )
        out["next_grad_2"] = _grad(backend, stack, track).tolist()
        for replicate in (1, 4):
            fresh, fresh_stack, _ = _setup(replicate, mine)
            load_train_state(path, fresh, rank)
            loaded = _state(fresh)
            out[f"resumed_equal_{replicate}"] = all(
                torch.equal(a, b) for a, b in zip(saved, loaded, strict=True)
            )
            out[f"next_grad_{replicate}"] = _grad(fresh, fresh_stack, track).tolist()
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_hsdp_meshes_give_the_whole_batch_gradient_and_reshard_on_resume(tmp_path):
    backend, stack, track = _setup(None, list(range(WORLD * PER_RANK)))
    reference = _grad(backend, stack, track)  # one process, all 16 samples, 4 micro-batches
    assert float(reference.norm()) > 0
    spawn_ranks(_rank, (str(tmp_path), str(tmp_path / "ckpt"), str(tmp_path)), WORLD)
    results = {r: torch.load(tmp_path / f"rank{r}.pt") for r in range(WORLD)}
    for rank, out in results.items():
        assert [out[f"mesh_{r}"] for r in MESHES] == [(4,), (2, 2), (4, 1)]
        for replicate in MESHES:
            got = torch.tensor(out[f"grad_{replicate}"])
            assert relative(got, reference) < 1e-5, (rank, replicate, relative(got, reference))
        assert out["resumed_equal_1"] and out["resumed_equal_4"], rank
        assert out["offload_policies"] == ["CPUOffloadPolicy"] and out["compute_device"] == "cpu"
        got = torch.tensor(out["grad_offload"])
        assert relative(got, reference) < 1e-5, (rank, relative(got, reference))
        assert out["offload_step_equal"], rank  # the same AdamW step, taken on the host shards
        want = torch.tensor(out["next_grad_2"])
        assert float(want.norm()) > 0
        for replicate in (1, 4):
            got = torch.tensor(out[f"next_grad_{replicate}"])
            assert relative(got, want) < 1e-5, (rank, replicate, relative(got, want))
