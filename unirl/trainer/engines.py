"""Where a run's rollouts happen, as the driver sees it: trainside or dedicated engines.

`RolloutSettings.of(cfg)` reads the recipe's `rollout` node: the trainside
engine (the train workers sample with the module they train) or a
`unirl.rollout.dedicated.DedicatedEngine` (engine actors with their own
weights, placed `colocate` on the training devices or `separate` after them,
fed by weight sync). Both give the trainer the same calls:

- `prepare(version)`: make the samplers hold the trainer's weights of
  `version` (dedicated: wake colocated engines, then sync if they are behind);
- `submit(req, partition) -> InFlightRollout`: start a rollout and return at
  once; the tracks go into the transport exactly as a trainside rollout's;
- `release()`: after a rollout, colocated engines sleep (their memory goes
  back while the trainer trains);
- `InFlightRollout.collect(...)`: wait chunk by chunk, scoring each chunk
  as it arrives (reward scoring overlaps the rest of the rollout), and return
  the meta and the scored reward view in request order.

With `overlap_reward`, a dedicated rollout is submitted as one call per
forward batch of every engine (chunk k = the k-th forward batch of each
engine's shard), so every forward is the forward a single call would run and
the samples, rewards and advantages are those of the one-call rollout.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from unirl.dataplane import BatchMeta, get_batch
from unirl.distributed.group import PendingCall, WorkerError, placement, remote
from unirl.rollout.dedicated import is_dedicated
from unirl.trainer.engine_worker import EngineWorker
from unirl.types.rollout_req import RolloutReq
from unirl.types.rollout_resp import RolloutTrack


@dataclass(frozen=True)
class RolloutSettings:
    """The driver's view of the recipe's rollout engine (see `DedicatedEngine` for the fields)."""

    dedicated: bool
    placement: str = "colocate"
    num_engines: int = 0
    max_staleness: int = 0
    sleep_level: int = 0
    overlap_reward: bool = False
    forward_batch_size: int | None = None
    partial_tokens: int | None = None

    @classmethod
    def of(cls, cfg: Any) -> RolloutSettings:
        """The settings of a recipe's `rollout` node."""
        return cls.of_node(cfg["rollout"])

    @classmethod
    def of_node(cls, node: Any) -> RolloutSettings:
        """The settings of an engine node (a recipe's `rollout`, a composed track's `engine`;
        None or a trainside engine: not dedicated)."""
        if node is None or not is_dedicated(node):
            return cls(dedicated=False)
        return cls(
            dedicated=True,
            placement=str(node.get("placement", "colocate")),
            num_engines=int(node.get("num_engines", 1)),
            max_staleness=int(node.get("max_staleness", 0)),
            sleep_level=int(node.get("sleep_level", 1)),
            overlap_reward=bool(node.get("overlap_reward", True)),
            forward_batch_size=node.get("forward_batch_size"),
            partial_tokens=node.get("partial_tokens"),
        )

    def pool_devices(self, num_devices: int) -> int:
        """Devices the run reserves: the training devices, plus the engines' own when separate."""
        return num_devices + (self.num_engines if self.placement == "separate" and self.dedicated else 0)


def concat_metas(parts: list[Any]) -> Any:
    """The engines' metas of one chunk, in engine order, as one: a `BatchMeta`, or (a unified
    engine's) `{track: BatchMeta}` concatenated track by track."""
    if isinstance(parts[0], dict):
        return {name: BatchMeta.concat([p[name] for p in parts]) for name in parts[0]}
    return BatchMeta.concat(parts)


def request_order(chunks: list[Any], parts: int) -> Any:
    """Reassemble per-sample chunks into request order.

    Chunk k holds `parts` equal pieces, piece e being the k-th forward batch of
    engine e's shard; the request is engine-major (engine e's shard whole, then
    engine e + 1's). Works for anything with `split` and `concat` (metas, tracks).
    """
    if len(chunks) == 1:
        return chunks[0]
    pieces = [c.split(parts) for c in chunks]
    return type(chunks[0]).concat([pieces[k][e] for e in range(parts) for k in range(len(chunks))])


class InFlightRollout:
    """A rollout in flight: `chunks` are called in order, each waiting for the next chunk's
    meta (every engine's next forward batch, in engine order); `version` is the weights'
    version the rollout samples."""

    def __init__(self, chunks: list[Callable[[], BatchMeta]], parts: int, version: int) -> None:
        self.chunks = chunks
        self.parts = parts
        self.version = version

    def collect(
        self, transport: Any, fields: list[str], score: Callable[[RolloutTrack], Any]
    ) -> tuple[BatchMeta, RolloutTrack, float]:
        """Wait for each chunk in turn, fetch its `fields` and `score` it (while later chunks
        still generate); returns (meta, scored view) in request order and the time
        (`time.perf_counter()`) the last chunk arrived. A failed chunk raises its `WorkerError`."""
        metas, tracks = [], []
        for chunk in self.chunks:
            meta = chunk()
            arrived = time.perf_counter()
            track = get_batch(transport, meta, fields)
            score(track)
            metas.append(meta)
            tracks.append(track)
        return request_order(metas, self.parts), request_order(tracks, self.parts), arrived

    def wait(self) -> Any:
        """Wait for every chunk; the meta in request order (one chunk: a shared backbone's
        `{track: BatchMeta}`)."""
        return request_order([chunk() for chunk in self.chunks], self.parts)


class PartialRollout:
    """A partial rollout in flight on dedicated engines (`rollout.partial_tokens`): started by
    weight `version` with its first segment, then one segment per sync (`extend`, by the weights
    just synced), finished by `collect` / `wait` with the weights held then. `stats` (after
    collecting): the tokens each weight version sampled, and the samples whose tokens span
    several versions (`resumed`), over every engine."""

    def __init__(self, group: Any, partition: str, version: int, calls: list[PendingCall]) -> None:
        self.group = group
        self.partition = partition
        self.version = version
        self.calls = calls  # the segments queued so far (their errors surface when collected)
        self.stats: dict[str, Any] = {}

    def extend(self, max_tokens: int | None) -> None:
        """Queue the next segment: at most `max_tokens` tokens per unfinished sample (None: to
        their end)."""
        self.calls.append(self.group.submit("partial_extend", self.partition, max_tokens))

    def _finish(self) -> BatchMeta:
        finishing = self.group.submit("partial_finish", self.partition)
        for call in self.calls:
            call.result()
        results = finishing.result()
        by_version: dict[int, int] = {}
        for _, stats in results:
            for version, n in stats["tokens_by_version"].items():
                by_version[version] = by_version.get(version, 0) + n
        self.stats = {
            "tokens_by_version": by_version,
            "resumed": sum(r[1]["resumed"] for r in results),
            "samples": sum(r[1]["samples"] for r in results),
        }
        return concat_metas([meta for meta, _ in results])

    def collect(
        self, transport: Any, fields: list[str], score: Callable[[RolloutTrack], Any]
    ) -> tuple[BatchMeta, RolloutTrack, float]:
        """Finish the rollout, fetch its `fields` and `score` it (one chunk, in request order);
        returns (meta, scored view, the time it arrived)."""
        meta = self._finish()
        arrived = time.perf_counter()
        track = get_batch(transport, meta, fields)
        score(track)
        return meta, track, arrived

    def wait(self) -> BatchMeta:
        return self._finish()


class TrainsideRollouts:
    """The train workers sample with the module they train: one call per rollout, nothing to sync.
    `track`: the composed track they sample (None: the run's own, or every track of a shared
    backbone, whose rollout is every track's meta by name)."""

    def __init__(self, group: Any, track: str | None = None) -> None:
        self.group = group
        self.track = track
        self.version = 0

    def prepare(self, version: int) -> dict[str, float]:
        self.version = version
        return {}

    def submit(self, req: RolloutReq, partition: str) -> InFlightRollout:
        named = () if self.track is None else (self.track,)
        call = self.group.submit("rollout", req, partition, *named)

        def wait() -> Any:
            metas = call.result()  # the ranks' metas, gathered; a shared backbone's: one dict per rank
            return concat_metas(metas) if isinstance(metas, list) else metas

        return InFlightRollout([wait], 1, self.version)

    def release(self) -> None:
        return None

    def process_info(self) -> list[dict[str, Any]]:
        return []

    def stats(self) -> list[dict[str, float]]:
        return []

    def shutdown(self) -> None:
        return None


class DedicatedRollouts:
    """Engine actors with their own weights, synced from the train workers.

    Args:
        settings: the recipe's rollout settings (dedicated).
        cfg: the resolved recipe as a plain dict.
        pool: the run's `DevicePool` (`settings.pool_devices(num_devices)` devices).
        trainer: the train workers' group (the weight-sync senders).
        transport_info: what the driver's transport `start()` returned.
        env: environment exported in the engine actors.
        engine_class: the engine actor (`EngineWorker`; a unified run's `UnifiedEngineWorker`,
            whose chunk is every track's meta by name).
        track: the track of a composed run these engines sample (`cfg` is then that track's
            view, `unirl.trainer.graph.track_recipe`); its weights are the ones synced.
        first_device: the pool index of the first separate engine (default: after the training
            devices; a composed run's second separate track starts after the first's engines).

    Builds the engines (colocate: on the first `num_engines` training devices;
    separate: on the devices after the training ones), then the sync: the
    trainer's rank 0 plans the payload (LoRA or full) and every engine binds it
    to its own module (a LoRA sync that would bind zero modules fails here,
    before the first step).
    """

    def __init__(
        self,
        settings: RolloutSettings,
        cfg: dict[str, Any],
        pool: Any,
        trainer: Any,
        transport_info: dict[str, Any],
        env: dict[str, str] | None = None,
        engine_class: type = EngineWorker,
        track: str | None = None,
        first_device: int | None = None,
    ) -> None:
        self.settings = settings
        self.trainer = trainer
        self.track = track
        first = 0
        if settings.placement == "separate":
            first = int(cfg["num_devices"]) if first_device is None else first_device
        where = placement(pool, settings.num_engines, first)
        self.group = remote(engine_class, where, cfg, transport_info, env=env)
        self.version: int | None = None
        self.asleep = False
        try:
            plan, endpoint, self.in_band = trainer.sync_setup(cfg["weight_sync"], settings.num_engines, track)
            self.group.sync_setup(cfg["weight_sync"], plan, endpoint)
            connecting = self.group.submit("sync_connect")  # in-band backends connect collectively
            trainer.sync_connect(track)
            connecting.result()
        except BaseException:
            self.shutdown()  # the caller never gets this object: leave no engine behind
            raise

    def prepare(self, version: int) -> dict[str, float]:
        """Wake colocated engines, then sync the trainer's weights of `version` into every
        engine if they hold another; returns `time/sync_s` and the sync's `sync/...` stats."""
        if self.asleep:
            self.group.wake_up()
            self.asleep = False
        if self.version == version:
            return {}
        start = time.perf_counter()
        if self.in_band:  # send and receive are one collective: start the receivers first
            receiving = self.group.submit("sync_receive", None)
            ticket, stats = self.trainer.sync_send(version, self.track)
            received = receiving.result()
        else:
            ticket, stats = self.trainer.sync_send(version, self.track)
            received = self.group.sync_receive(ticket)
        self.version = version
        out = {k: v for k, v in stats.items() if k != "sync/version"}
        # the slowest engine's times; an engine's own extras (a vLLM push and probe): their largest
        for key in (
            {k for r in received for k in r if k != "sync/version"}
            - set(out)
            - {"sync/bytes", "sync/buckets"}
        ):
            out[key] = max(r[key] for r in received if key in r)
        out["time/sync_s"] = time.perf_counter() - start
        return out

    def submit(self, req: RolloutReq, partition: str) -> InFlightRollout:
        """Start `req` on the engines (split evenly, in engine order) and queue one
        `rollout_next` call per chunk on every engine; with `overlap_reward` a chunk is one
        forward batch of each engine's shard, so the engines sample ahead of the scoring."""
        if self.version is None:
            raise RuntimeError("DedicatedRollouts.submit before prepare(): the engines hold no weights")
        parts = self.settings.num_engines
        size, step = len(req) // parts, self.settings.forward_batch_size
        chunked = bool(self.settings.overlap_reward and step and step < size)
        started = self.group.submit("rollout", req, partition, chunked)
        calls = [self.group.submit("rollout_next") for _ in range(-(-size // step) if chunked else 1)]

        def chunk(call: PendingCall, first: bool) -> Callable[[], BatchMeta]:
            def wait() -> BatchMeta:
                if first:
                    started.result()
                return concat_metas(call.result())

            return wait

        return InFlightRollout([chunk(c, i == 0) for i, c in enumerate(calls)], parts, self.version)

    def submit_partial(self, req: RolloutReq, partition: str) -> PartialRollout:
        """Start `req` as a partial rollout (split evenly, in engine order) and queue its first
        segment of `settings.partial_tokens` tokens, by the weights the engines hold."""
        if self.version is None:
            raise RuntimeError(
                "DedicatedRollouts.submit_partial before prepare(): the engines hold no weights"
            )
        started = self.group.submit("partial_start", req, partition, self.settings.partial_tokens)
        return PartialRollout(self.group, partition, self.version, [started])

    def save_drafts(self, path: str) -> None:
        """Every engine writes its partial rollouts in flight into checkpoint directory `path`."""
        self.group.save_drafts(path)

    def load_drafts(self, path: str, versions: dict[int, int]) -> list[PartialRollout]:
        """Every engine restores the partial rollouts `save_drafts` wrote; returns them as
        `PartialRollout`s, step by step (`versions`: each step's starting weight version)."""
        partitions = self.group.load_drafts(path)[0]
        return [
            PartialRollout(self.group, p, versions[int(p.removeprefix("step_"))], [])
            for p in sorted(partitions, key=lambda p: int(p.removeprefix("step_")))
        ]

    def release(self) -> None:
        """After a rollout: colocated engines with a sleep level release their weights' memory."""
        if self.settings.placement == "colocate" and self.settings.sleep_level > 0 and not self.asleep:
            self.group.sleep()
            self.asleep = True

    def save_weights(self, path: str) -> None:
        """Engine 0 writes the synced weights it samples into checkpoint directory `path` (after
        the rollouts queued on it)."""
        self.group.save_weights(path)

    def load_weights(self, path: str, version: int) -> None:
        """Every engine loads the weights `save_weights` wrote, as weight version `version`."""
        self.group.load_weights(path, version)
        self.version = version

    def process_info(self) -> list[dict[str, Any]]:
        return self.group.process_info()

    def stats(self) -> list[dict[str, float]]:
        """Each engine's `dataplane/...` totals since the last call."""
        return self.group.dataplane_stats()

    def memory_mb(self) -> list[dict[str, float]]:
        return self.group.memory_mb()

    def shutdown(self) -> None:
        try:
            self.group.teardown()
        except WorkerError:
            pass  # a dead engine has nothing left to close
        self.group.shutdown()
