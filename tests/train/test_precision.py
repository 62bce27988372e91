"""Mixed precision and activation checkpointing are exercised, not only configured.

bf16 autocast of the stage's forward (one rank), FSDP2's bf16 parameter policy
(two gloo ranks in spawned processes) and activation checkpointing (one rank,
and under FSDP2) are checked on CPU by what the forward actually computes in
and by how often the blocks run; the CUDA variants are in the `gpu` tier.
"""

from __future__ import annotations

import pytest
import torch

from tests.conftest import tiny_model_config
from tests.gloo import join_gloo, rank_context
from unirl.models.sd3 import SD3Stage
from unirl.models.sd3.bundle import SD3Bundle
from unirl.train.backend import OptimConfig, TrainBackend
from unirl.train.fsdp import FSDPConfig

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _inputs(bundle, device, n=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    c, h, w = bundle.latent_shape(16, 16)
    stage = SD3Stage(bundle)
    cond = stage.encode_prompts(["a red square", "a blue circle"][:n], 1.0, 8)
    x = torch.randn(n, c, h, w, generator=g).to(device)
    sigma = torch.full((n,), 0.6, device=device)
    return x, sigma, cond


def _block_compute_dtypes(module) -> tuple[list[torch.dtype], object]:
    """Record the dtype of the first linear layer's weight each time a transformer block runs."""
    seen: list[torch.dtype] = []
    block = module.transformer_blocks[0]
    first = next(m for m in block.modules() if isinstance(m, torch.nn.Linear))
    handle = first.register_forward_pre_hook(lambda m, args: seen.append((m.weight.dtype, args[0].dtype)))
    return seen, handle


@pytest.mark.parametrize("device", DEVICES)
def test_bf16_autocast_runs_the_blocks_in_bf16_and_returns_fp32(device):
    bundle = tiny_model_config().build().to(device)
    x, sigma, cond = _inputs(bundle, device)
    fp32 = SD3Stage(bundle)
    bf16 = SD3Stage(bundle, autocast_dtype="bfloat16")
    seen, handle = _block_compute_dtypes(bundle.transformer)
    with torch.no_grad():
        v32 = fp32.velocity(x, sigma, cond, 1.0)
        n32 = len(seen)
        v16 = bf16.velocity(x, sigma, cond, 1.0)
    handle.remove()
    # fp32 master weights either way; autocast feeds the matmul bf16 inputs
    assert seen[:n32] == [(torch.float32, torch.float32)] * n32
    assert all(inp == torch.bfloat16 for _, inp in seen[n32:]) and len(seen) > n32
    assert v16.dtype == torch.float32 and v16.device.type == device
    rel = ((v16 - v32).norm() / v32.norm()).item()
    assert 0 < rel < 0.05, rel  # bf16 rounding: visible, small
    with torch.no_grad():  # deterministic: rollout and replay share this forward, so ratios stay exactly 1
        assert torch.equal(bf16.velocity(x, sigma, cond, 1.0), v16)


def _count_block_runs(module) -> list[int]:
    """Count forwards of the inner JointTransformerBlocks (checkpoint wrappers recompute them in backward)."""
    calls = [0]
    for m in module.modules():
        if type(m).__name__.endswith("JointTransformerBlock"):  # FSDP2 renames it FSDPJointTransformerBlock
            m.register_forward_pre_hook(lambda *a: calls.__setitem__(0, calls[0] + 1))
    return calls


def _grads_of(backend: TrainBackend, bundle, x, sigma, cond) -> tuple[list[torch.Tensor], int]:
    stage = SD3Stage(bundle)
    stage.module = backend.module
    calls = _count_block_runs(backend.module)
    loss = stage.velocity(x, sigma, cond, 1.0).square().mean()
    loss.backward()
    grads = [p.grad.detach().clone() for p in backend.params]
    return grads, calls[0]


def test_activation_checkpointing_on_one_rank_recomputes_blocks_and_keeps_gradients():
    x, sigma, cond = _inputs(tiny_model_config().build(), "cpu")
    results = {}
    for ac in (False, True):
        bundle = tiny_model_config().build()
        fsdp = FSDPConfig(block_classes=["JointTransformerBlock"], activation_checkpointing=ac)
        backend = TrainBackend(bundle.transformer, None, OptimConfig(lr=1e-3), 1, fsdp=fsdp)
        results[ac] = _grads_of(backend, bundle, x, sigma, cond)
    (g_plain, runs_plain), (g_ckpt, runs_ckpt) = results[False], results[True]
    num_blocks = 1  # tiny_model_config: num_layers=1
    assert runs_plain == num_blocks and runs_ckpt == 2 * num_blocks  # forward, then the recompute
    assert len(g_plain) == len(g_ckpt)
    for a, b in zip(g_plain, g_ckpt, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def _fsdp_rank(rank: int, world: int, rdzv: str, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    join_gloo(rank, world, rdzv)
    try:
        out = {}
        for ac in (False, True):
            torch.manual_seed(0)
            bundle = tiny_model_config().build()
            x, sigma, cond = _inputs(bundle, "cpu", seed=rank)
            fsdp = FSDPConfig(
                block_classes=["JointTransformerBlock"],
                param_dtype="bfloat16",
                reduce_dtype="float32",
                activation_checkpointing=ac,
            )
            backend = TrainBackend(bundle.transformer, None, OptimConfig(lr=1e-3), 1, fsdp=fsdp)
            inner = next(
                m for m in backend.module.modules() if type(m).__name__.endswith("JointTransformerBlock")
            )
            first = next(m for m in inner.modules() if isinstance(m, torch.nn.Linear))
            seen: list[torch.dtype] = []
            first.register_forward_pre_hook(lambda m, a, seen=seen: seen.append(m.weight.dtype))
            grads, runs = _grads_of(backend, bundle, x, sigma, cond)
            metrics = backend.optimizer_step()
            out[ac] = {
                "compute_dtypes": sorted({str(d) for d in seen}),
                "block_runs": runs,
                "param_dtypes": sorted({str(p.dtype) for p in backend.params}),
                "grad_dtypes": sorted({str(g.dtype) for g in grads}),
                "sharded": all(type(p).__name__ == "DTensor" for p in backend.params),
                "grad_norm": metrics["train/grad_norm"],
            }
        queue.put((rank, out))
    finally:
        dist.destroy_process_group()


def test_fsdp2_bf16_policy_computes_in_bf16_keeps_fp32_masters_and_checkpoints_blocks(tmp_path):
    world, rdzv = 2, str(tmp_path)
    ctx = rank_context()
    queue = ctx.Queue()
    procs = [ctx.Process(target=_fsdp_rank, args=(r, world, rdzv, queue)) for r in range(world)]
    for p in procs:
        p.start()
    results = {}
    while len(results) < world:
        try:
            rank, out = queue.get(timeout=5)
            results[rank] = out
        except Exception:  # noqa: BLE001 - queue.Empty: check that no rank died before reporting
            dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
            assert not dead, f"a rank died (exit codes {dead}); its traceback is above"
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in range(world):
        for ac in (False, True):
            r = results[rank][ac]
            assert r["compute_dtypes"] == ["torch.bfloat16"], r  # all-gathered params in bf16
            assert r["param_dtypes"] == ["torch.float32"] and r["grad_dtypes"] == ["torch.float32"], r
            assert r["sharded"], r
            assert r["block_runs"] == (2 if ac else 1), r
            assert r["grad_norm"] > 0 and r["grad_norm"] == results[0][ac]["grad_norm"]  # reduced over ranks


def test_lora_export_with_activation_checkpointing_equals_the_plain_export(tmp_path):
    """Checkpoint wrappers rename modules (`_checkpoint_wrapped_module.`): the LoRA file must not lose them."""
    from safetensors.torch import load_file

    from unirl.train.backend import LoRAConfig

    files = []
    for ac in (False, True):
        torch.manual_seed(0)
        bundle = tiny_model_config().build()
        lora = LoRAConfig(rank=2, alpha=4, init_lora_weights="gaussian")
        fsdp = FSDPConfig(block_classes=["JointTransformerBlock"], activation_checkpointing=ac)
        TrainBackend(
            bundle.transformer, lora, OptimConfig(), 1, fsdp=fsdp, writer=SD3Bundle.write_weights
        ).save_weights(str(tmp_path / str(ac)), None)
        files.append(load_file(str(tmp_path / str(ac) / "pytorch_lora_weights.safetensors")))
    plain, ckpt = files
    assert plain and sorted(plain) == sorted(ckpt)
    assert all(torch.equal(plain[k], ckpt[k]) for k in plain)
