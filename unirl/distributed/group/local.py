"""A worker group of one worker in the driver's own process: the same calls as a Ray group, no Ray.

`in_process(cls, *args)` builds ``cls(RankInfo(rank 0 of 1), *args)`` here and
returns a `LocalWorkerGroup` whose ``group.method(...)`` runs the method with
the method's dispatch mode exactly as `WorkerGroup` does for one rank, so the
driver loop is the same code with or without Ray. This is how a run goes on a
machine without Ray (the GPU test tier) and how tests reach every tensor of a
worker directly (`group.worker`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unirl.distributed.group.dispatch import DISPATCH_SPECS, Dispatch, dispatch_mode
from unirl.distributed.group.rank import RankInfo
from unirl.distributed.group.remote import WorkerError


class LocalWorkerGroup:
    """Driver-side handle of one in-process worker, with `WorkerGroup`'s call interface.

    A method that raises becomes `WorkerError` (rank 0, the method, the cause
    chained), as a failing Ray actor would.
    """

    def __init__(self, worker: Any) -> None:
        self.worker = worker
        self.rank_infos = [worker.rank_info]
        self.world_size = 1

    def call(self, method: str, *args: Any, mode: Dispatch | None = None, **kwargs: Any) -> Any:
        """Call `method` on the worker with dispatch `mode` (default: the method's tag)."""
        fn = getattr(type(self.worker), method, None)
        if method.startswith("_") or not callable(fn):
            raise AttributeError(f"{type(self.worker).__name__} has no public method {method!r}")
        spec = DISPATCH_SPECS[mode if mode is not None else dispatch_mode(fn)]
        (call,) = spec.scatter(1, args, kwargs)
        try:
            result = getattr(self.worker, method)(*call[0], **call[1])
        except Exception as exc:
            raise WorkerError(type(self.worker).__name__, 0, method, exc) from exc
        return spec.gather([result])

    def submit(self, method: str, *args: Any, mode: Dispatch | None = None, **kwargs: Any) -> DoneCall:
        """`WorkerGroup.submit`'s interface: the call runs here and now (one process, nothing
        runs beside the driver); `.result()` returns its result or raises its `WorkerError`."""
        try:
            return DoneCall(self.call(method, *args, mode=mode, **kwargs))
        except WorkerError as exc:
            return DoneCall(error=exc)

    def __getattr__(self, name: str) -> Callable[..., Any]:
        if name.startswith("_"):
            raise AttributeError(name)

        def call(*args: Any, **kwargs: Any) -> Any:
            return self.call(name, *args, **kwargs)

        return call

    def shutdown(self) -> None:
        """Nothing to kill: the worker lives in this process and goes with it."""


class DoneCall:
    """A finished call with `PendingCall`'s interface (`done()`, `result()`)."""

    def __init__(self, value: Any = None, error: WorkerError | None = None) -> None:
        self.value = value
        self.error = error

    def done(self) -> bool:
        return True

    def result(self) -> Any:
        if self.error is not None:
            raise self.error
        return self.value


def in_process(cls: type, *args: Any, **kwargs: Any) -> LocalWorkerGroup:
    """Construct ``cls(RankInfo(rank=0, world_size=1), *args, **kwargs)`` here; a failing
    constructor raises `WorkerError` (method ``__init__``), as `remote` does."""
    try:
        worker = cls(RankInfo(rank=0, world_size=1, dp_rank=0, dp_size=1), *args, **kwargs)
    except Exception as exc:
        raise WorkerError(cls.__name__, 0, "__init__", exc) from exc
    return LocalWorkerGroup(worker)
