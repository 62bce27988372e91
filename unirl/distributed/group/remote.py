"""Worker base class and the driver-side handle of a group of Ray worker actors."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any

import ray
import torch
from ray.actor import ActorHandle

from unirl.distributed.group.device_pool import Placement, node_ip
from unirl.distributed.group.dispatch import DISPATCH_SPECS, Dispatch, dispatch_mode, in_groups
from unirl.distributed.group.hosts import HostedActor, HostPool, active_pool, kill
from unirl.distributed.group.rank import RankInfo

# A device is shared by up to this many colocated worker groups by default.
MAX_COLOCATED = 10
# How long the driver waits for the port probe on rank 0's node.
PORT_PROBE_TIMEOUT_S = 60.0


class WorkerError(RuntimeError):
    """A worker of a group raised or died during a call.

    The message names the worker class, the rank and the method; the Ray
    error (``RayTaskError``/``RayActorError``) is chained as ``__cause__``.
    """

    def __init__(self, worker_cls: str, rank: int, method: str, cause: BaseException) -> None:
        self.worker_cls = worker_cls
        self.rank = rank
        self.method = method
        detail = str(getattr(cause, "cause", None) or cause).strip().splitlines()
        reason = detail[-1] if detail else type(cause).__name__
        super().__init__(f"{worker_cls}.{method} failed on rank {rank}: {type(cause).__name__}: {reason}")


class Worker:
    """Base class of worker-group members (run as Ray actors).

    ``__init__`` stores `rank_info`, calls ``torch.set_num_threads(num_threads)``
    (class attribute, default 1; override in a subclass) and exports
    ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE`` and
    ``LOCAL_RANK`` so ``torch.distributed.init_process_group(backend)`` works
    with the default ``env://`` init. It does NOT create a process group:
    subclasses decide whether and which backend (and must destroy it).
    Extra ``*args``/``**kwargs`` are accepted and ignored so subclasses can
    forward their own arguments.
    """

    num_threads: int = 1

    def __init__(self, rank_info: RankInfo, *args: Any, **kwargs: Any) -> None:
        self.rank_info = rank_info
        torch.set_num_threads(self.num_threads)
        os.environ["MASTER_ADDR"] = rank_info.master_addr
        if rank_info.master_port:
            os.environ["MASTER_PORT"] = str(rank_info.master_port)
        os.environ["RANK"] = str(rank_info.rank)
        os.environ["WORLD_SIZE"] = str(rank_info.world_size)
        os.environ["LOCAL_RANK"] = str(rank_info.local_rank)

    reusable_process: bool = False
    """Whether `reuse_processes()` may build this class in a warm host (`group.hosts`): a class
    that sets it builds all its state in `__init__` and leaves its process as it found it once
    torn down."""

    def process_reusable(self) -> bool:
        """Whether this process may host the next worker after this one is dropped: no process
        group left (`teardown` destroys it). Subclasses add what else they hold process-wide."""
        return not torch.distributed.is_initialized()

    def process_facts(self, device: Any) -> dict[str, Any]:
        """Where this member runs: host, process id, `device`, niceness and torch threads (what a
        run's placement.json records of each worker and engine)."""
        return {
            "hostname": socket.gethostname(),
            "pid": os.getpid(),
            "device": str(device),
            "niceness": os.nice(0),
            "torch_threads": torch.get_num_threads(),
        }


class WorkerGroup:
    """Driver-side handle of `world_size` worker actors; build it with `remote(...)`.

    ``group.method(*args, **kwargs)`` calls ``method`` of the worker class on
    the ranks chosen by its dispatch tag (see `Dispatch`) and BLOCKS until
    every called rank has returned; all ranks are submitted before waiting, so
    collectives inside the method cannot deadlock on the driver. If a rank
    raises or its actor dies, `WorkerError` is raised at once (other ranks may
    still be running or stuck in a collective: shut the group down). Calls are
    not thread-safe. Private names (leading ``_``) are not callable remotely.
    """

    def __init__(
        self,
        worker_cls: type,
        actors: list[ActorHandle],
        rank_infos: list[RankInfo],
        hosts: tuple[HostPool, dict[str, str]] | None = None,
    ) -> None:
        if len(actors) != len(rank_infos):
            raise ValueError("one RankInfo per actor is required")
        self._worker_cls = worker_cls
        self._actors = list(actors)
        self._rank_infos = list(rank_infos)
        self._closed = False
        self._hosts = hosts  # (the pool, the hosts' env) when the ranks live in warm hosts
        self._failed = False  # a rank raised or died: its hosts are not reused
        self.data_group_size = 1
        """Ranks per data-parallel group (a sequence-parallel group shares its samples):
        `Dispatch.DP_SCATTER` calls give each group one part (`in_groups`)."""

    @property
    def worker_cls(self) -> type:
        """The (undecorated) worker class."""
        return self._worker_cls

    @property
    def world_size(self) -> int:
        """Number of ranks."""
        return len(self._actors)

    @property
    def rank_infos(self) -> list[RankInfo]:
        """RankInfo of every rank, in rank order."""
        return list(self._rank_infos)

    @property
    def actors(self) -> list[ActorHandle]:
        """Ray actor handle of every rank, in rank order (a warm host's, `group.hosts`)."""
        return [a.host if isinstance(a, HostedActor) else a for a in self._actors]

    def call(self, method: str, *args: Any, mode: Dispatch | None = None, **kwargs: Any) -> Any:
        """Call worker method `method` with dispatch `mode` (default: the method's tag) and block."""
        return self.submit(method, *args, mode=mode, **kwargs).result()

    def submit(self, method: str, *args: Any, mode: Dispatch | None = None, **kwargs: Any) -> PendingCall:
        """Start `method` on the ranks as `call` does and return at once; `.result()` waits.

        Each actor runs its calls in submission order, so calls submitted one after
        another (even before earlier ones finish) run in that order on every rank."""
        if self._closed:
            raise RuntimeError(f"{self._worker_cls.__name__} group has been shut down")
        fn = getattr(self._worker_cls, method, None)
        if method.startswith("_") or not callable(fn):
            raise AttributeError(f"{self._worker_cls.__name__} has no public method {method!r}")
        mode = mode if mode is not None else dispatch_mode(fn)
        spec = DISPATCH_SPECS[mode]
        if mode is Dispatch.DP_SCATTER:
            spec = in_groups(spec, self.data_group_size)
        calls = spec.scatter(self.world_size, args, kwargs)
        pending: dict[ray.ObjectRef, int] = {}
        for rank, call in enumerate(calls):
            if call is None:
                continue
            rank_args, rank_kwargs = call
            try:
                ref = getattr(self._actors[rank], method).remote(*rank_args, **rank_kwargs)
            except ray.exceptions.RayError as err:
                raise WorkerError(self._worker_cls.__name__, rank, method, err) from err
            pending[ref] = rank
        return PendingCall(self, method, pending, spec.gather)

    def _wait(self, pending: dict[ray.ObjectRef, int], method: str) -> dict[int, Any]:
        """Results by rank; raises WorkerError on the first failing rank."""
        results: dict[int, Any] = {}
        refs = list(pending)
        while refs:
            ready, refs = ray.wait(refs, num_returns=1)
            for ref in ready:
                rank = pending[ref]
                try:
                    results[rank] = ray.get(ref)
                except ray.exceptions.RayError as err:
                    self._failed = True
                    raise WorkerError(self._worker_cls.__name__, rank, method, err) from err
        return results

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)
        fn = getattr(self._worker_cls, name, None)
        if not callable(fn):
            raise AttributeError(f"{self._worker_cls.__name__} has no public method {name!r}")

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.call(name, *args, **kwargs)

        call.__name__ = name
        call.__doc__ = fn.__doc__
        return call

    def shutdown(self) -> None:
        """Kill every actor of the group (warm hosts go back to their pool when the group saw no
        failure and each worker says its process can be reused). Idempotent; later calls raise
        RuntimeError."""
        if self._closed:
            return
        self._closed = True
        if self._hosts is not None:
            pool, env = self._hosts
            pool.give_back(self.actors, env, reuse=not self._failed)
            return
        for actor in self._actors:
            kill(actor)

    def __repr__(self) -> str:
        return f"WorkerGroup({self._worker_cls.__name__}, world_size={self.world_size})"


class PendingCall:
    """A worker-group call in flight (`WorkerGroup.submit`).

    `result()` blocks until every called rank returned and gathers their results
    as the method's dispatch mode says; a rank that raised or died raises
    `WorkerError` naming it. `done()` tells without blocking.
    """

    def __init__(self, group: WorkerGroup, method: str, pending: dict[ray.ObjectRef, int], gather) -> None:
        self.group = group
        self.method = method
        self._pending = pending
        self._gather = gather

    def done(self) -> bool:
        """True when every called rank has finished (returned, raised or died)."""
        refs = list(self._pending)
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return len(ready) == len(refs)

    def result(self) -> Any:
        results = self.group._wait(self._pending, self.method)
        return self._gather([results[r] for r in sorted(results)])


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on `host` right now (of the machine this runs on)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


def _port_probe_fn() -> Callable[[str], tuple[int, str]]:
    """A fresh probe ``host -> (port free on host, Ray node id it ran on)``.

    Built as a closure so Ray ships it by value: the probe's worker process
    does not import unirl (nor torch).
    """

    def probe(host: str) -> tuple[int, str]:
        import socket

        import ray

        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind((host, 0))
            port = int(sock.getsockname()[1])
        return port, ray.get_runtime_context().get_node_id()

    return probe


def rendezvous(placement: Placement) -> tuple[str, int]:
    """torch.distributed rendezvous endpoint ``(master_addr, master_port)`` of a group on `placement`.

    If every bundle of the placement is on the driver's Ray node: 127.0.0.1
    and a port free on the driver (single-node behaviour). Otherwise the IP of
    the node hosting rank 0's bundle (``NodeManagerAddress`` in Ray's node
    table) and a port found free on that node by a zero-CPU Ray task pinned to
    rank 0's bundle. Like any free-port probe the port may be taken again
    before rank 0 binds it (a small race).

    Raises:
        RuntimeError: if the probe fails, times out (PORT_PROBE_TIMEOUT_S) or
            lands on another node than rank 0's bundle.
    """
    pool = placement.pool
    if on_driver_node(placement):
        return "127.0.0.1", free_port()
    rank0_node = pool.bundle_node_ids()[placement.bundle_indices[0]]
    addr = node_ip(rank0_node)
    task = ray.remote(_port_probe_fn()).options(
        num_cpus=0, scheduling_strategy=pool.scheduling_strategy(placement.bundle_indices[0])
    )
    try:
        port, probed_node = ray.get(task.remote(addr), timeout=PORT_PROBE_TIMEOUT_S)
    except (ray.exceptions.RayError, TimeoutError) as err:
        raise RuntimeError(
            f"could not find a free port on rank 0's node {addr} ({rank0_node}): {err}"
        ) from err
    if probed_node != rank0_node:
        raise RuntimeError(
            f"port probe for rank 0 ran on node {probed_node}, not on rank 0's node {rank0_node} ({addr})"
        )
    return addr, int(port)


def _local_and_node_ranks(node_ids: list[str]) -> tuple[list[int], list[int]]:
    nodes: dict[str, int] = {}
    seen: dict[str, int] = {}
    local, node = [], []
    for nid in node_ids:
        node.append(nodes.setdefault(nid, len(nodes)))
        local.append(seen.get(nid, 0))
        seen[nid] = local[-1] + 1
    return local, node


def remote(
    cls: type,
    placement: Placement,
    *args: Any,
    num_cpus_per_worker: float | None = None,
    num_gpus_per_worker: float | None = None,
    env: dict[str, str] | None = None,
    **kwargs: Any,
) -> WorkerGroup:
    """Start ``placement.world_size`` actors of ``cls`` and return their `WorkerGroup`.

    Rank i runs on bundle ``placement.bundle_indices[i]`` and is constructed as
    ``cls(rank_info_i, *args, **kwargs)``. Each actor reserves
    ``num_cpus_per_worker`` CPUs of its bundle (default: the bundle's CPUs /
    MAX_COLOCATED) and, on GPU pools, ``num_gpus_per_worker`` of its GPU
    (default 1 / MAX_COLOCATED), so up to MAX_COLOCATED groups can share a
    placement by default. `env` is exported in every actor (Ray runtime_env).
    The rendezvous endpoint is `rendezvous(placement)`: 127.0.0.1 and a port
    free on the driver when every rank is on the driver's node, else rank 0's
    node IP and a port free there. Blocks until every actor is constructed; a failing
    constructor raises `WorkerError` (method ``__init__``) after killing the
    group. Inside `hosts.reuse_processes()`, a class with `reusable_process` on a CPU
    placement on the driver's node is built in warm hosts instead (`group.hosts`).
    """
    pool = placement.pool
    if num_cpus_per_worker is None:
        num_cpus_per_worker = pool.cpus_per_device / MAX_COLOCATED
    if not 0 <= num_cpus_per_worker <= pool.cpus_per_device:
        raise ValueError(f"num_cpus_per_worker={num_cpus_per_worker} must be in [0, {pool.cpus_per_device}]")
    if pool.is_gpu:
        num_gpus = 1.0 / MAX_COLOCATED if num_gpus_per_worker is None else num_gpus_per_worker
    else:
        num_gpus = 0.0
    world_size = placement.world_size
    node_ids = pool.bundle_node_ids()
    local_ranks, node_ranks = _local_and_node_ranks([node_ids[b] for b in placement.bundle_indices])
    master_addr, port = rendezvous(placement)
    rank_infos = [
        RankInfo(
            rank=r,
            world_size=world_size,
            dp_rank=r,
            dp_size=world_size,
            local_rank=local_ranks[r],
            node_rank=node_ranks[r],
            master_addr=master_addr,
            master_port=port,
        )
        for r in range(world_size)
    ]
    env = {str(k): str(v) for k, v in (env or {}).items()}
    hosts = active_pool()
    if hosts is not None and cls.reusable_process and not pool.is_gpu and on_driver_node(placement):
        warm = hosts.take(world_size, env)
        group = WorkerGroup(cls, [HostedActor(h) for h in warm], rank_infos, hosts=(hosts, env))
        ready = {h.build.remote(cls, rank_infos[r], *args, **kwargs): r for r, h in enumerate(warm)}
    else:
        options: dict[str, Any] = {"num_cpus": num_cpus_per_worker, "num_gpus": num_gpus}
        if env:
            options["runtime_env"] = {"env_vars": env}
        actor_cls = ray.remote(cls)
        actors = [
            actor_cls.options(scheduling_strategy=pool.scheduling_strategy(bundle), **options).remote(
                rank_infos[r], *args, **kwargs
            )
            for r, bundle in enumerate(placement.bundle_indices)
        ]
        group = WorkerGroup(cls, actors, rank_infos)
        ready = {actor.__ray_ready__.remote(): r for r, actor in enumerate(actors)}
    try:
        group._wait(ready, "__init__")
    except WorkerError:
        group.shutdown()
        raise
    return group


def on_driver_node(placement: Placement) -> bool:
    """Whether every bundle of `placement` is on the driver's Ray node."""
    node_ids = placement.pool.bundle_node_ids()
    here = ray.get_runtime_context().get_node_id()
    return all(node_ids[b] == here for b in placement.bundle_indices)
