"""Worker processes kept warm across runs: Ray actors that host one worker object at a time.

A Ray actor's process lives and dies with the actor, and a train worker's process spends most of
its start-up importing torch, transformers and diffusers (about 8 s a rank on a 2-core CPU)
before it builds anything. A driver that starts many short runs one after another (a test
session, a sweep of tiny recipes) can keep those processes instead: inside `reuse_processes()`,
`remote(...)` builds each rank's worker inside a `Host` actor taken from the driver's pool, and
the group's `shutdown()` hands the hosts back instead of killing them.

A host goes back to the pool only when nothing of the run can leak into the next one: the group
saw no failure, the worker says its process can be reused (`Worker.process_reusable`: its
process group destroyed, no library with process-wide state inside; a vLLM engine never is) and
the release succeeded; any other host is killed, as a plain group's actors are. Hosts are used
only where a plain actor would make no difference: CPU pools whose bundles are all on the
driver's node, and worker classes that opt in (`Worker.reusable_process`). Each worker class
still builds from scratch (its seed, threads, environment, model), so a run on warm hosts writes
the rows of a run on fresh actors; the placement-group reservation and the actor's process title
are the hosts' (a host reserves no CPU: its run's placement group holds them).
"""

from __future__ import annotations

import contextlib
import gc
import os
from collections.abc import Iterator
from typing import Any

import ray
from ray.actor import ActorHandle

# At most this many idle hosts per environment and rank are kept (each holds an imported torch stack).
MAX_IDLE = 2


class Host:
    """One warm process: builds a worker (`build`), forwards its method calls (`call`) and drops
    it again (`release`)."""

    def __init__(self) -> None:
        self.worker: Any = None

    def build(self, cls: type, *args: Any, **kwargs: Any) -> int:
        """Construct `cls(*args, **kwargs)` here; returns this process's id."""
        if self.worker is not None:
            raise RuntimeError(f"this host already holds a {type(self.worker).__name__}")
        self.worker = cls(*args, **kwargs)
        return os.getpid()

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """The hosted worker's `method(*args, **kwargs)`."""
        return getattr(self.worker, method)(*args, **kwargs)

    def release(self) -> bool:
        """Drop the worker; whether this process may host the next one (the worker's say)."""
        worker, self.worker = self.worker, None
        reusable = worker is not None and worker.process_reusable()
        del worker
        gc.collect()
        return reusable

    def alive(self) -> bool:
        return True


class HostedActor:
    """A rank's handle when its worker lives in a `Host`: `handle.method.remote(...)` calls the
    worker's method through the host, as an actor handle of the worker class would."""

    def __init__(self, host: ActorHandle) -> None:
        self.host = host

    def __getattr__(self, method: str) -> _HostedMethod:
        if method.startswith("__"):
            raise AttributeError(method)
        return _HostedMethod(self.host, method)


class _HostedMethod:
    def __init__(self, host: ActorHandle, method: str) -> None:
        self.host, self.method = host, method

    def remote(self, *args: Any, **kwargs: Any) -> ray.ObjectRef:
        return self.host.call.remote(self.method, *args, **kwargs)


class HostPool:
    """Idle hosts by the environment they were started with (`runtime_env` env vars) and the rank
    they last hosted. A host only ever hosts one rank: torch keeps process-wide caches keyed by a
    device mesh's ranks but not by which of them this process is (DTensor's sharding
    propagation), so a process that was rank 1 of a 2-rank mesh and then rank 0 of an equal one
    writes its shard at rank 1's offset (measured: a resumed run's step 3 differed)."""

    def __init__(self, max_idle: int = MAX_IDLE) -> None:
        self.max_idle = max_idle
        self.idle: dict[tuple, list[ActorHandle]] = {}

    @staticmethod
    def _key(env: dict[str, str], rank: int) -> tuple:
        return (tuple(sorted(env.items())), rank)

    def take(self, n: int, env: dict[str, str]) -> list[ActorHandle]:
        """Hosts for ranks 0..n-1 started with `env`: for each rank an idle one that hosted it
        before and still answers, else a new one."""
        options: dict[str, Any] = {"num_cpus": 0}
        if env:
            options["runtime_env"] = {"env_vars": dict(env)}
        hosts: list[ActorHandle] = []
        for rank in range(n):
            idle = self.idle.get(self._key(env, rank), [])
            host = None
            while idle and host is None:
                host = idle.pop()
                try:
                    ray.get(host.alive.remote(), timeout=10)
                except (ray.exceptions.RayError, TimeoutError):
                    kill(host)
                    host = None
            hosts.append(host if host is not None else ray.remote(Host).options(**options).remote())
        return hosts

    def give_back(self, hosts: list[ActorHandle], env: dict[str, str], reuse: bool) -> None:
        """Release each rank's worker; keep the hosts that may host their rank again (up to
        `max_idle` a rank), kill the rest."""
        releases = [h.release.remote() for h in hosts] if reuse else []
        for rank, host in enumerate(hosts):
            ok = False
            if releases:
                try:
                    ok = bool(ray.get(releases[rank], timeout=60))
                except (ray.exceptions.RayError, TimeoutError):
                    ok = False
            idle = self.idle.setdefault(self._key(env, rank), [])
            if ok and len(idle) < self.max_idle:
                idle.append(host)
            else:
                kill(host)

    def close(self) -> None:
        for hosts in self.idle.values():
            for host in hosts:
                kill(host)
        self.idle.clear()


def kill(actor: ActorHandle) -> None:
    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001 - already dead or Ray gone: nothing left to kill
        pass


_active: list[HostPool] = []


def active_pool() -> HostPool | None:
    """The pool `remote(...)` builds in, inside `reuse_processes()`; else None."""
    return _active[-1] if _active and ray.is_initialized() else None


@contextlib.contextmanager
def reuse_processes(pool: HostPool | None = None, max_idle: int = MAX_IDLE) -> Iterator[HostPool]:
    """Inside the block, worker groups of opted-in classes are built in warm hosts of `pool` and
    their processes kept for the next group (module docstring). A new pool's idle hosts are
    killed at the block's end; a given pool stays open for another block (`pool.close()`)."""
    own = pool is None
    pool = HostPool(max_idle) if pool is None else pool
    _active.append(pool)
    try:
        yield pool
    finally:
        _active.remove(pool)
        if own and ray.is_initialized():
            pool.close()
