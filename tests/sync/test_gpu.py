"""The GPU backends of weight sync (the GPU tier: `pytest -m gpu`; skipped without CUDA).

Two spawned processes: the parent sends, a child receives and sends back what it got.
The CUDA IPC test passed on an H200 (docs/results/devices.md). Its first two tries there hung:
the child put its LoRA parameters (which require grad) on the queue undetached, the queue's
feeder thread refused to pickle them, and the parent waited for a result that never came.
"""

from __future__ import annotations

import queue

import pytest
import torch
import torch.multiprocessing as mp

from tests.sync.helpers import SD3_LORA, sd3, with_lora
from unirl.sync import WeightSyncConfig, bind, make_receiver, make_sender, plan_for, select

pytestmark = pytest.mark.gpu


def _engine(cfg: dict, device: str, inbox: mp.Queue, outbox: mp.Queue) -> None:
    """Child: an engine on `device` receiving one sync into a LoRA SD3 subject."""
    plan, endpoint = inbox.get()
    module = with_lora(sd3(0), 4, SD3_LORA, adapter="engine").to(device)
    receiver = make_receiver(WeightSyncConfig(**cfg), plan, endpoint, device=device)
    receiver.connect()
    ticket = None if cfg["backend"] == "broadcast" else inbox.get()
    receiver.receive(ticket, into=bind(module, plan))
    outbox.put({n: t.detach().cpu() for n, t in select(module.named_parameters(), "lora").items()})
    inbox.get()  # hold on until the parent has the result
    receiver.close()


def _result(child, outbox: mp.Queue, timeout_s: float = 120.0):
    """The child's result; fails at once, with its exit code, if the child dies first (an engine
    that cannot open the IPC handle must not read as a hang)."""
    waited = 0.0
    while waited < timeout_s:
        try:
            return outbox.get(timeout=2.0)
        except queue.Empty:
            waited += 2.0
            if not child.is_alive():
                pytest.fail(f"the engine process died before answering (exit code {child.exitcode})")
    pytest.fail(f"no answer from the engine process in {timeout_s:.0f} s (alive: {child.is_alive()})")


def _sync(backend: str, engine_device: str) -> None:
    cfg = {"backend": backend, "bucket_mb": 0.01, "wire_dtype": "bfloat16", "verify": True}
    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=_engine, args=(cfg, engine_device, inbox, outbox))
    child.start()
    try:
        trainer = with_lora(sd3(0), 3, SD3_LORA).to("cuda:0")
        wcfg = WeightSyncConfig(**cfg)
        plan = plan_for(trainer, "lora", wcfg)
        sender = make_sender(wcfg, plan, device="cuda:0")
        inbox.put((plan, sender.endpoint()))
        sender.connect()
        ticket = sender.send(trainer.named_parameters(), 1)
        if backend != "broadcast":
            inbox.put(ticket)
        got = _result(child, outbox)
        sent = {n: t.detach().cpu() for n, t in select(trainer.named_parameters(), "lora").items()}
        assert list(got) == list(sent)
        assert all(torch.equal(got[n], t.to(torch.bfloat16).float()) for n, t in sent.items())
        inbox.put("done")
        sender.close()
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()


def test_cuda_ipc_between_processes_on_one_gpu() -> None:
    _sync("cuda_ipc", "cuda:0")


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a GPU per process")
def test_nccl_broadcast_between_two_gpus() -> None:
    _sync("broadcast", "cuda:1")
