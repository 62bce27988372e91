"""Merging concurrent score requests into scorer calls (the reward server's batching).

Requests that wait while the scorer is busy (or arrive within `window_s` of the
first waiting one) are scored in one scorer call, up to `max_batch` samples, when
they are of one kind (image size, metadata and response lengths present or not).
This relies on the scorer contract: a sample's score does not depend on the other
samples of the call. A request larger than `max_batch` is scored alone;
`max_batch=1` turns merging off. A failed merged call is retried request by
request, so one bad request fails alone. Scorer calls run one at a time on one
worker thread (scorers need not be thread-safe); the event loop keeps accepting
and decoding requests meanwhile.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from unirl.reward.base import RewardBackend
from unirl.types.reward import RewardRequest, RewardResponse


@dataclass
class _Job:
    req: RewardRequest
    future: asyncio.Future
    key: tuple = field(init=False)

    def __post_init__(self) -> None:
        shape = None if self.req.images is None else tuple(self.req.images.shape[1:])
        self.key = (shape, bool(self.req.metadata), self.req.response_lengths is not None)


def merge_requests(reqs: list[RewardRequest]) -> RewardRequest:
    """One request holding every sample of `reqs` (one kind), in order. Group ids are kept
    apart per request (prefixed with its index), so two clients' groups never merge; they are
    dropped unless every request has them."""
    first = reqs[0]
    grouped = all(r.group_ids for r in reqs)
    return RewardRequest(
        group_ids=[f"{i}:{g}" for i, r in enumerate(reqs) for g in r.group_ids] if grouped else [],
        sample_ids=[s for r in reqs for s in r.sample_ids],
        prompts=[p for r in reqs for p in r.prompts],
        metadata=[m for r in reqs for m in r.metadata],
        images=None if first.images is None else torch.cat([r.images for r in reqs]),
        texts=None if first.texts is None else [t for r in reqs for t in r.texts],
        response_lengths=None
        if first.response_lengths is None
        else [n for r in reqs for n in r.response_lengths],
    )


class Batcher:
    """Scores requests for an asyncio server, merging concurrent ones (the module docstring).

    Create and `start()` it inside the running loop; `await score(req)` returns the
    backend's response for `req` alone; `await stop()` ends it.
    """

    def __init__(
        self,
        backend: RewardBackend,
        max_batch: int,
        window_s: float,
        initializer: Callable[[], object] | None = None,
        before_each: Callable[[], object] | None = None,
    ) -> None:
        self.backend, self.max_batch, self.window_s = backend, max_batch, window_s
        self.before_each = before_each  # run in the scorer's thread before each scorer call
        self.pending: list[_Job] = []
        self.scorer_calls = 0
        self._wake = asyncio.Event()
        # initializer: run once in the scorer's thread (the server's: its torch threads' governor)
        self._executor = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="reward-scorer", initializer=initializer
        )
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        self._executor.shutdown(wait=True)

    async def score(self, req: RewardRequest) -> RewardResponse:
        """The backend's response for `req` alone (scored together with others that fit)."""
        job = _Job(req, asyncio.get_running_loop().create_future())
        self.pending.append(job)
        self._wake.set()
        return await job.future

    def _take(self) -> list[_Job]:
        first = self.pending[0]
        batch, size = [first], len(first.req)
        for job in self.pending[1:]:
            if job.key == first.key and size + len(job.req) <= self.max_batch:
                batch.append(job)
                size += len(job.req)
        self.pending = [j for j in self.pending if all(j is not b for b in batch)]
        return batch

    async def _run(self) -> None:
        while True:
            if not self.pending:
                self._wake.clear()
                await self._wake.wait()
                continue
            if self.window_s > 0:
                await asyncio.sleep(self.window_s)
            await self._score(self._take())

    def _score_now(self, req: RewardRequest) -> RewardResponse:
        if self.before_each is not None:
            self.before_each()
        return self.backend.score(req)

    async def _call(self, req: RewardRequest) -> RewardResponse:
        self.scorer_calls += 1
        resp = await asyncio.get_running_loop().run_in_executor(self._executor, self._score_now, req)
        for name, scores in resp.components.items():
            if not isinstance(scores, torch.Tensor) or tuple(scores.shape) != (len(req),):
                got = list(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__
                raise RuntimeError(f"backend returned component {name!r} as {got}, not [B={len(req)}]")
        return resp

    async def _score(self, batch: list[_Job]) -> None:
        jobs = [j for j in batch if not j.future.done()]  # a client that went away needs no answer
        if not jobs:
            return
        if len(jobs) > 1:
            try:
                resp = await self._call(merge_requests([j.req for j in jobs]))
            except Exception:  # noqa: BLE001 - score request by request so only the bad one fails
                pass
            else:
                start = 0
                for job in jobs:
                    end = start + len(job.req)
                    part = RewardResponse({n: s[start:end].clone() for n, s in resp.components.items()})
                    if not job.future.done():
                        job.future.set_result(part)
                    start = end
                return
        for job in jobs:
            try:
                resp = await self._call(job.req)
            except Exception as e:  # noqa: BLE001 - the handler turns it into a 422 / 500 answer
                if not job.future.done():
                    job.future.set_exception(e)
            else:
                if not job.future.done():
                    job.future.set_result(resp)
