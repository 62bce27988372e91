"""Worker groups on a real local Ray cluster (one cluster for the module)."""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import ray
import torch

from tests.ray_loopback import SHARED_NUM_CPUS
from unirl.distributed.group import (
    DevicePool,
    Dispatch,
    RankInfo,
    Worker,
    WorkerError,
    WorkerGroup,
    dispatch,
    placement,
    remote,
)

pytestmark = pytest.mark.ray

# Ray workers cannot import this test module by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


@dataclass
class IntBatch:
    """Tiny batch: split into equal contiguous parts, concat in order."""

    values: list[int]

    def split(self, parts: int) -> list[IntBatch]:
        size = len(self.values) // parts
        return [IntBatch(self.values[i * size : (i + 1) * size]) for i in range(parts)]

    @staticmethod
    def concat(parts: list[IntBatch]) -> IntBatch:
        return IntBatch([v for p in parts for v in p.values])


class EchoWorker(Worker):
    def __init__(self, rank_info: RankInfo, offset: int = 0) -> None:
        super().__init__(rank_info)
        self.offset = offset
        self.rank_zero_calls = 0

    def info(self) -> tuple[RankInfo, dict[str, str], int]:
        import os

        keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
        return self.rank_info, {k: os.environ[k] for k in keys}, torch.get_num_threads()

    def plus(self, x: int) -> int:
        return x + self.offset + self.rank_info.rank

    @dispatch(Dispatch.DP_SCATTER)
    def tag(
        self, batch: IntBatch, scale: int = 1, metrics: bool = False
    ) -> IntBatch | dict[str, float] | None:
        if metrics:
            return {"n": float(len(batch.values)), "rank": float(self.rank_info.rank)}
        if scale == 0:
            return None
        return IntBatch([v * scale * 10 + self.rank_info.rank for v in batch.values])

    @dispatch(Dispatch.RANK_ZERO)
    def bump(self) -> int:
        self.rank_zero_calls += 1
        return self.rank_info.rank

    def count(self) -> int:
        return self.rank_zero_calls

    @dispatch(Dispatch.ALL_RANKS_RETURN_ZERO)
    def whoami(self) -> int:
        return self.rank_info.rank

    def explode(self) -> None:
        if self.rank_info.rank == 1:
            raise ValueError("boom on purpose")

    def all_reduce(self) -> list[float]:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo")
        t = torch.tensor([1.0, 2.0]) * (self.rank_info.rank + 1)
        dist.all_reduce(t)
        return t.tolist()

    def teardown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.fixture(scope="module")
def pool(ray_cluster) -> Iterator[DevicePool]:
    p = DevicePool(2, cpus_per_device=1.0, use_gpu=False, timeout_s=30)
    yield p
    p.shutdown()


@pytest.fixture(scope="module")
def group(pool: DevicePool) -> Iterator[WorkerGroup]:
    g = remote(EchoWorker, placement(pool), offset=100, num_cpus_per_worker=0.5)
    yield g
    g.shutdown()


def test_rank_info_and_env(group: WorkerGroup) -> None:
    assert group.world_size == 2 and len(group.actors) == 2
    out = group.info()
    port = group.rank_infos[0].master_port
    assert port > 0
    for r, (info, env, threads) in enumerate(out):
        assert info == group.rank_infos[r]
        assert (info.rank, info.world_size, info.dp_rank, info.dp_size) == (r, 2, r, 2)
        assert (info.local_rank, info.node_rank, info.tp_size) == (r, 0, 1)
        assert env == {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": str(r),
        }
        assert threads == 1


def test_broadcast(group: WorkerGroup) -> None:
    assert group.plus(1) == [101, 102]
    assert group.plus(x=5) == [105, 106]


def test_dp_scatter_split_and_gather(group: WorkerGroup) -> None:
    out = group.tag(IntBatch([1, 2, 3, 4]), scale=2)
    assert out == IntBatch([20, 40, 61, 81])
    metrics = group.tag(IntBatch([1, 2, 3, 4]), metrics=True)
    assert metrics == [{"n": 2.0, "rank": 0.0}, {"n": 2.0, "rank": 1.0}]
    assert group.tag(IntBatch([1, 2]), scale=0) is None
    with pytest.raises(ValueError, match="tensor of shape"):
        group.call("plus", torch.zeros(3), mode=Dispatch.DP_SCATTER)


def test_dp_scatter_in_groups_gives_a_group_one_part(group: WorkerGroup) -> None:
    """With `data_group_size` 2 (a sequence-parallel group of both ranks) the one part goes to
    both ranks, and only the group's first rank's result comes back."""
    group.data_group_size = 2
    try:
        metrics = group.tag(IntBatch([1, 2, 3, 4]), metrics=True)
        assert metrics == [{"n": 4.0, "rank": 0.0}]
        assert group.plus(1) == [101, 102]  # broadcast is unchanged
    finally:
        group.data_group_size = 1


def test_rank_zero_calls_only_rank_zero(group: WorkerGroup) -> None:
    before = group.count()
    assert group.bump() == 0
    assert group.bump() == 0
    after = group.count()
    assert [a - b for a, b in zip(after, before, strict=True)] == [2, 0]
    assert group.whoami() == 0


def test_method_error_names_rank_and_method(group: WorkerGroup) -> None:
    with pytest.raises(WorkerError, match=r"EchoWorker\.explode failed on rank 1.*boom on purpose") as exc:
        group.explode()
    assert isinstance(exc.value.__cause__, ray.exceptions.RayTaskError)
    assert (exc.value.rank, exc.value.method) == (1, "explode")
    assert group.plus(0) == [100, 101]  # the actor survives a raising method


def test_gloo_all_reduce(group: WorkerGroup) -> None:
    try:
        out = group.all_reduce()
    finally:
        group.teardown()
    assert out == [[3.0, 6.0], [3.0, 6.0]]


def _wait_until_dead(actor, timeout_s: float = 60.0) -> None:
    """``ray.kill`` is asynchronous: a call made right after it can still run. Wait for the death."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            ray.get(actor.__ray_ready__.remote(), timeout=5)
        except ray.exceptions.RayActorError:
            return
        except ray.exceptions.GetTimeoutError:
            pass
        time.sleep(0.1)
    raise AssertionError("the killed actor is still alive after 60 s")


def test_killed_actor_raises_worker_error(pool: DevicePool) -> None:
    g = remote(EchoWorker, placement(pool), num_cpus_per_worker=0.25)
    try:
        ray.kill(g.actors[1])
        _wait_until_dead(g.actors[1])
        with pytest.raises(WorkerError, match=r"EchoWorker\.plus failed on rank 1") as exc:
            g.plus(1)
        assert isinstance(exc.value.__cause__, ray.exceptions.RayActorError)
    finally:
        g.shutdown()
        g.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        g.plus(1)


def test_device_pool_too_many_devices_fails_fast(pool: DevicePool) -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"reserve 64 CPU-slot devices.*Lower num_devices") as exc:
        DevicePool(64, use_gpu=False, timeout_s=1.0)
    assert f"CPU: {SHARED_NUM_CPUS}" in str(exc.value)
    assert time.monotonic() - start < 10
