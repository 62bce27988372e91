"""Weight sync through real backends on a local Ray cluster: the object store and a gloo broadcast
group between separate processes (Ray actors), with real diffusers / transformers / peft models."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch

import tests.sync.helpers as helpers
from tests.sync.helpers import LM_LORA, SD3_LORA, SyncActor, sd3
from unirl.distributed.group import free_port
from unirl.sync import SyncPlan, WeightSyncConfig, WeightSyncError, bind, make_receiver, make_sender, plan_for

pytestmark = pytest.mark.ray

# Ray workers cannot import the test package by name: ship the helpers by value
ray.cloudpickle.register_pickle_by_value(helpers)
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

BACKENDS = ["object_store", "broadcast"]
BUCKET_MB = 0.05  # 52 KB: the SD3 payload spans ~90 buckets and its feed-forward weights are split
# (sender build, receiver build, kind): LoRA cases share the base weights (seed 0), as a trainer
# and an engine loaded from one checkpoint do; the adapters differ until synced
CASES: dict[str, tuple[tuple, tuple, str]] = {
    "sd3_full": (("sd3", 1, None), ("sd3", 2, None), "full"),
    "sd3_lora": (
        ("sd3", 0, {"seed": 3, "targets": SD3_LORA}),
        ("sd3", 0, {"seed": 4, "targets": SD3_LORA, "adapter": "engine"}),
        "lora",
    ),
    "lm_lora": (
        ("lm", 0, {"seed": 3, "targets": LM_LORA}),
        ("lm", 0, {"seed": 4, "targets": LM_LORA, "adapter": "rollout", "peft_model": True}),
        "lora",
    ),
}


@pytest.fixture(scope="module")
def cluster(ray_cluster) -> str:
    """The session's shared Ray instance (tests/ray_loopback.py)."""
    return ray_cluster


def new_actor() -> Any:
    return ray.remote(num_cpus=0.5)(SyncActor).remote()


@pytest.fixture(scope="module")
def trio(cluster: None) -> Iterator[tuple[Any, Any, Any]]:
    """Three sides kept for the module (each costs seconds of imports to start)."""
    actors = new_actor(), new_actor(), new_actor()
    yield actors
    for actor in actors:
        ray.kill(actor)


@pytest.fixture
def pair(trio: tuple[Any, Any, Any]) -> tuple[Any, Any]:
    return trio[:2]


def connect(sender: Any, receivers: list[Any], cfg: dict, plan: SyncPlan, senders: tuple = ()) -> None:
    """Sender (and non-source trainer ranks `senders`), receivers, then all connect at once."""
    endpoint = ray.get(sender.make_sender.remote(cfg, plan, num_receivers=len(receivers)))
    ray.get([s.make_sender.remote(cfg, plan, source=False) for s in senders])
    ray.get([r.make_receiver.remote(cfg, plan, endpoint, i) for i, r in enumerate(receivers)])
    ray.get([x.connect.remote() for x in (sender, *receivers)])


def sync(sender: Any, receivers: list[Any], backend: str, version: int, senders: tuple = ()) -> list[dict]:
    """One sync driven as the trainer would: in band, every side at once; otherwise the ticket is
    handed from the sender to each receiver."""
    if backend == "broadcast":
        calls = [s.send.remote(version) for s in (sender, *senders)]
        return ray.get(calls + [r.receive.remote(None) for r in receivers])[len(calls) :]
    ticket = ray.get([s.send.remote(version) for s in (sender, *senders)])[0]
    return ray.get([r.receive.remote(ticket) for r in receivers])


def as_received(sent: dict[str, torch.Tensor], wire: str | None) -> dict[str, torch.Tensor]:
    """What the receiver must hold: the sender's tensors, through the wire dtype and back."""
    if wire is None:
        return sent
    dtype = getattr(torch, wire)
    return {n: t.to(dtype).to(t.dtype) for n, t in sent.items()}


def assert_same(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert list(got) == list(expected)
    wrong = [n for n in got if got[n].dtype != expected[n].dtype or not torch.equal(got[n], expected[n])]
    assert not wrong, f"{len(wrong)} tensors differ, e.g. {wrong[:3]}"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    ("case", "wire"),
    [("sd3_full", None), ("sd3_full", "bfloat16"), ("sd3_lora", "float32"), ("lm_lora", None)],
)
def test_sync_is_bit_exact(pair: tuple[Any, Any], backend: str, case: str, wire: str | None) -> None:
    sender, receiver = pair
    send_build, recv_build, kind = CASES[case]
    ray.get([sender.build.remote(*send_build), receiver.build.remote(*recv_build)])
    bucket_mb = BUCKET_MB if kind == "full" else BUCKET_MB / 8  # the LoRA payloads are 20-45 KB
    cfg = {"backend": backend, "bucket_mb": bucket_mb, "wire_dtype": wire, "verify": True}
    plan = ray.get(sender.plan.remote(kind, cfg))
    assert len(plan.buckets) > 1
    if kind == "full":  # some tensor is split between buckets
        assert any(p.start > 0 for bucket in plan.buckets for p in bucket)
    sent = ray.get(sender.state.remote(kind))
    before = ray.get(receiver.state.remote(kind))
    assert list(before) == list(sent) and not any(torch.equal(before[n], sent[n]) for n in sent)
    if kind == "lora":
        assert not torch.equal(ray.get(sender.forward.remote()), ray.get(receiver.forward.remote()))
    connect(sender, [receiver], cfg, plan)
    for version in (1, 2):
        if version == 2:  # the trainer moves on; the same group carries the next version
            ray.get(sender.perturb.remote(kind, seed=version))
            sent = ray.get(sender.state.remote(kind))
        (stats,) = sync(sender, [receiver], backend, version)
        assert stats["sync/version"] == version and stats["sync/bytes"] == plan.wire_nbytes
        assert_same(ray.get(receiver.state.remote(kind)), as_received(sent, wire))
    if wire is None or wire == "float32":  # the engine now samples exactly as the trainer would
        assert torch.equal(ray.get(sender.forward.remote()), ray.get(receiver.forward.remote()))
    ray.get([sender.close.remote(), receiver.close.remote()])


def test_broadcast_to_two_engines(trio: tuple[Any, Any, Any]) -> None:
    sender, first, second = trio
    try:
        send_build, recv_build, kind = CASES["sd3_lora"]
        ray.get(
            [
                sender.build.remote(*send_build),
                first.build.remote(*recv_build),
                second.build.remote(*recv_build),
            ]
        )
        cfg = {"backend": "broadcast", "bucket_mb": BUCKET_MB}
        plan = ray.get(sender.plan.remote(kind, cfg))
        connect(sender, [first, second], cfg, plan)
        sync(sender, [first, second], "broadcast", 1)
        sent = ray.get(sender.state.remote(kind))
        for engine in (first, second):
            assert_same(ray.get(engine.state.remote(kind)), sent)
    finally:
        ray.get([x.close.remote() for x in trio])


@pytest.mark.parametrize("backend", BACKENDS)
def test_fsdp2_sharded_trainer_syncs_whole_weights(trio: tuple[Any, Any, Any], backend: str) -> None:
    """Two FSDP2 trainer ranks (activation checkpointing wrappers in the names) gather each tensor with
    `full_tensor()` while rank 0 sends; the engine gets what the trainer backend consolidates."""
    rank0, engine, rank1 = trio
    try:
        port = free_port()
        ray.get([rank0.build_fsdp.remote(0, 2, port, seed=5), rank1.build_fsdp.remote(1, 2, port, seed=5)])
        ray.get(engine.build.remote("sd3", 6))
        cfg = {"backend": backend, "bucket_mb": BUCKET_MB, "verify": True}
        plan = ray.get(rank0.plan.remote("full", cfg))
        assert plan.names == [n for n, _ in sd3(0).named_parameters()]  # no wrapper segments left
        connect(rank0, [engine], cfg, plan, senders=(rank1,))
        sync(rank0, [engine], backend, 1, senders=(rank1,))
        trainer = ray.get([rank0.full_state.remote(), rank1.full_state.remote()])[0]
        assert_same(ray.get(engine.state.remote("full")), trainer)
    finally:
        ray.get([x.close.remote() for x in trio])


# ---- failures ---------------------------------------------------------------------------------------


def _local(backend: str = "object_store", **cfg: Any) -> tuple[Any, Any, torch.nn.Module, torch.nn.Module]:
    """Sender and receiver of the object store in this (driver) process, on two SD3 subjects."""
    trainer, engine = sd3(1), sd3(2)
    wcfg = WeightSyncConfig(backend=backend, bucket_mb=BUCKET_MB, **cfg)
    plan = plan_for(trainer, "full", wcfg)
    return make_sender(wcfg, plan), make_receiver(wcfg, plan, None), trainer, engine


def test_sender_refuses_tensors_that_do_not_match_the_plan(cluster: None) -> None:
    sender, _, trainer, _ = _local()
    params = dict(trainer.named_parameters())
    name = "transformer_blocks.0.attn.to_q.weight"
    with pytest.raises(WeightSyncError, match=rf"1 planned tensor\(s\) missing on the trainer: {name}"):
        sender.send([(n, p) for n, p in params.items() if n != name], 1)
    with pytest.raises(WeightSyncError, match=r"not in the plan: extra\.weight"):
        sender.send([*params.items(), ("extra.weight", torch.zeros(2))], 1)
    with pytest.raises(
        WeightSyncError, match=rf"{name}: shape \[128, 64\] on the trainer, plan \[128, 128\]"
    ):
        sender.send({**params, name: params[name][:, :64]}.items(), 1)
    with pytest.raises(
        WeightSyncError, match=rf"{name}: dtype torch.bfloat16 on the trainer, plan torch.float32"
    ):
        sender.send({**params, name: params[name].to(torch.bfloat16)}.items(), 1)


def test_corrupted_bucket_in_the_object_store(cluster: None) -> None:
    sender, receiver, trainer, engine = _local()
    into = bind(engine, receiver.plan)
    ticket = sender.send(trainer.named_parameters(), 1)
    good = ticket.frames[2]
    bad = ray.get(good).copy()
    bad[100] ^= 0x10
    ticket.frames[2] = ray.put(bad)
    tensors = ", ".join(receiver.plan.bucket_tensors(2))
    with pytest.raises(
        WeightSyncError, match=rf"bucket 2 of version 1 arrived corrupted .* it holds {tensors}"
    ):
        receiver.receive(ticket, into=into)
    assert receiver.version == -1  # the failed sync did not count
    ticket.frames[2] = good
    receiver.receive(ticket, into=into)
    assert receiver.version == 1
    assert all(torch.equal(into[n], p) for n, p in trainer.named_parameters())


def test_corrupted_bucket_on_the_broadcast_keeps_the_stream_in_step(pair: tuple[Any, Any]) -> None:
    """The receiver drains every bucket before it raises, so the sender finishes and the next
    version goes through the same group."""
    sender, receiver = pair
    ray.get([sender.build.remote("sd3", 1), receiver.build.remote("sd3", 2)])
    cfg = {"backend": "broadcast", "bucket_mb": BUCKET_MB}
    plan = ray.get(sender.plan.remote("full", cfg))
    endpoint = ray.get(sender.make_sender.remote(cfg, plan, corrupt=(1, 3)))
    ray.get(receiver.make_receiver.remote(cfg, plan, endpoint))
    ray.get([sender.connect.remote(), receiver.connect.remote()])
    send, receive = sender.send.remote(1), receiver.receive.remote(None)
    ray.get(send)
    with pytest.raises(ray.exceptions.RayTaskError, match="bucket 3 of version 1 arrived corrupted"):
        ray.get(receive)
    sync(sender, [receiver], "broadcast", 2)
    assert_same(ray.get(receiver.state.remote("full")), ray.get(sender.state.remote("full")))
    ray.get([sender.close.remote(), receiver.close.remote()])


def test_ticket_from_another_plan_or_an_old_version_is_refused(cluster: None) -> None:
    sender, receiver, trainer, _ = _local()
    other = make_receiver(
        WeightSyncConfig(backend="object_store", bucket_mb=2 * BUCKET_MB),
        plan_for(trainer, "full", WeightSyncConfig(backend="object_store", bucket_mb=2 * BUCKET_MB)),
        None,
    )
    ticket = sender.send(trainer.named_parameters(), 4)
    with pytest.raises(WeightSyncError, match="version 4 was built from another plan"):
        other.receive(ticket)
    receiver.receive(ticket)
    with pytest.raises(
        WeightSyncError, match=r"version 4 is not newer than the engine's weights \(version 4\)"
    ):
        receiver.receive(ticket)
    with pytest.raises(WeightSyncError, match="needs the sender's ticket"):
        receiver.receive(None)


def test_verify_catches_what_the_bucket_checksums_cannot(cluster: None) -> None:
    """Two destination names that alias one tensor: every bucket arrives intact, but after the
    sync the first tensor holds the second's values. Only verify mode notices."""
    a, b = "transformer_blocks.0.attn.to_q.weight", "transformer_blocks.0.attn.to_k.weight"
    for verify in (False, True):
        sender, receiver, trainer, engine = _local(verify=verify)
        into = bind(engine, receiver.plan)
        into[b] = into[a]
        ticket = sender.send(trainer.named_parameters(), 1)
        if not verify:
            receiver.receive(ticket, into=into)
            continue
        assert ticket.piece_checksums.shape == (len(receiver.plan.pieces), 3)
        with pytest.raises(WeightSyncError, match=rf"verify: after sync version 1, 1 tensor\(s\) .* {a}$"):
            receiver.receive(ticket, into=into)


def test_killed_engine_fails_the_broadcast_fast(pair: tuple[Any, Any]) -> None:
    sender, _ = pair
    doomed = new_actor()  # receives into fresh tensors: no model to build
    ray.get(sender.build.remote("sd3", 1))
    cfg = {"backend": "broadcast", "bucket_mb": BUCKET_MB, "timeout_s": 20}
    plan = ray.get(sender.plan.remote("full", cfg))
    connect(sender, [doomed], cfg, plan)
    ray.kill(doomed)
    start = time.monotonic()
    with pytest.raises(
        ray.exceptions.RayTaskError, match=r"weight sync broadcast of .* failed \(a peer died"
    ):
        ray.get(sender.send.remote(1))
    assert time.monotonic() - start < 30
    ray.get(sender.close.remote())
