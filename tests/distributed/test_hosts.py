"""Warm worker processes (`unirl.distributed.group.hosts`) on the shared local Ray instance: a
group built inside `reuse_processes()` runs each rank in a host that a finished group of the same
rank handed back, and only a host that nothing can leak from is handed back."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
import ray
import torch.distributed as dist

from unirl.distributed.group import DevicePool, RankInfo, Worker, WorkerError, placement, remote
from unirl.distributed.group.hosts import HostedActor, reuse_processes
from unirl.trainer.engine_worker import EngineWorker

pytestmark = pytest.mark.ray

# Ray workers cannot import this test module by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])


class Counter(Worker):
    """Opts in; its state starts at `start` whichever process builds it."""

    reusable_process = True

    def __init__(self, rank_info: RankInfo, start: int = 0, fail_on_rank: int | None = None) -> None:
        super().__init__(rank_info)
        if rank_info.rank == fail_on_rank:
            raise ValueError(f"rank {fail_on_rank} refuses to build")
        self.count = start

    def where(self) -> tuple[int, int, int]:
        """(process id, this worker's rank, its count), counting the call."""
        self.count += 1
        return os.getpid(), self.rank_info.rank, self.count

    def explode(self) -> None:
        if self.rank_info.rank == 1:  # one rank, so which rank the error names is not a race
            raise ValueError("boom on purpose")

    def join_gloo(self) -> None:
        dist.init_process_group("gloo")

    def teardown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


class Plain(Counter):
    """Does not opt in: its ranks are actors of their own, as without the pool."""

    reusable_process = False


@pytest.fixture(scope="module")
def pool(ray_cluster) -> Iterator[DevicePool]:
    p = DevicePool(2, cpus_per_device=1.0, use_gpu=False, timeout_s=30)
    yield p
    p.shutdown()


def pids(cls: type, pool: DevicePool, n: int = 2, **kwargs) -> list[int]:
    """Build a group of `n` ranks of `cls`, ask each where it runs, shut it down cleanly."""
    group = remote(cls, placement(pool, n), **kwargs)
    try:
        out = group.where()
        assert [(rank, count) for _, rank, count in out] == [
            (r, kwargs.get("start", 0) + 1) for r in range(n)
        ]
        group.teardown()
        return [pid for pid, _, _ in out]
    finally:
        group.shutdown()


def test_each_rank_is_built_again_in_the_process_that_hosted_it(pool: DevicePool) -> None:
    """Two groups one after the other: rank r of the second runs in rank r's process of the
    first, with its own fresh state; a smaller group takes rank 0's, never rank 1's."""
    with reuse_processes() as hosts:
        first = pids(Counter, pool)
        assert len(set(first)) == 2 and os.getpid() not in first
        assert pids(Counter, pool, start=5) == first
        assert pids(Counter, pool, n=1) == first[:1]
        assert [len(v) for v in hosts.idle.values()] == [1, 1]


def test_a_group_that_failed_leaves_no_process_behind(pool: DevicePool) -> None:
    """A rank that raised, or a constructor that failed, and the group's hosts are killed: the
    next group starts in new processes."""
    with reuse_processes():
        first = pids(Counter, pool)
        group = remote(Counter, placement(pool))
        assert isinstance(group._actors[0], HostedActor)
        with pytest.raises(WorkerError, match=r"Counter\.explode failed on rank 1.*boom on purpose"):
            group.explode()
        group.shutdown()
        second = pids(Counter, pool)
        assert not set(second) & set(first)
        with pytest.raises(WorkerError, match=r"Counter\.__init__ failed on rank 1.*rank 1 refuses to build"):
            remote(Counter, placement(pool), fail_on_rank=1)
        assert not set(pids(Counter, pool)) & set(second)


def test_a_process_group_left_open_is_not_reused(pool: DevicePool) -> None:
    """A worker that joined a process group and was not torn down says its process cannot be
    reused; after `teardown` it can."""
    with reuse_processes():
        group = remote(Counter, placement(pool))
        first = [pid for pid, _, _ in group.where()]
        group.join_gloo()
        group.shutdown()  # no teardown
        second = pids(Counter, pool)
        assert not set(second) & set(first)
        group = remote(Counter, placement(pool))
        group.join_gloo()
        group.teardown()
        group.shutdown()
        assert pids(Counter, pool) == second


def test_a_class_that_does_not_opt_in_gets_actors_of_its_own(pool: DevicePool) -> None:
    with reuse_processes() as hosts:
        group = remote(Plain, placement(pool))
        assert group._hosts is None and not isinstance(group._actors[0], HostedActor)
        group.shutdown()
        assert not set(pids(Plain, pool)) & set(pids(Plain, pool))
        assert hosts.idle == {}


def test_an_engine_holding_a_server_is_not_reused() -> None:
    """vLLM's engine core keeps process-wide state: an engine with `close` (a server) vetoes
    its process's reuse; a plain dedicated engine does not."""

    class Server:
        def close(self) -> None:
            pass

    worker = object.__new__(EngineWorker)
    worker.engine = Server()
    assert not worker.process_reusable()
    worker.engine = object()
    assert worker.process_reusable()
