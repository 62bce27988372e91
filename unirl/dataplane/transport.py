"""The transport contract: bulky per-sample data moves by handle, not through the driver.

A producer (a rollout worker) `put`s a batch of fields keyed by sample ids
into a *partition* (one training step) and gets back a `BatchMeta`: ids,
field schema, jagged lengths, the partition and a backend handle. Metas are
small; the driver gathers them, splits them by rank (`BatchMeta.split`, used
by the DP_SCATTER dispatch) and hands each consumer its shard, which `get`s
only the fields it needs. The driver `claim`s a meta for a consumer task
before handing it out (exactly-once per task) and `clear`s the partition in a
``finally`` when the step ends, so a failed step leaks nothing.

Every backend returns the same values for the same batch (see
`unirl.dataplane.codec`). Backends implement `_put`, `_get`, `_clear` (and
may override `attach`/`close`); timing and byte counts are recorded in one
place, `Transport.put`/`get`, as ``dataplane/...`` metrics.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from unirl.dataplane.codec import (
    FieldSpec,
    Skeleton,
    decode_field,
    encode_field,
    flatten,
    nbytes,
    spec_of,
    unflatten,
)
from unirl.types import batch as batch_ops


class DataPlaneError(RuntimeError):
    """A transport operation failed or was misused; the message names the partition/field/task."""


@dataclass
class BatchMeta(batch_ops.SampleBatch):
    """Where a batch lives: small, picklable, split and concatenated by sample.

    Attributes:
        backend: name of the transport that wrote it.
        partition: the partition (step) the samples belong to.
        sample_ids: [B] sample ids, in batch order.
        fields: field name -> `FieldSpec`.
        lengths: jagged field name -> [B] first-dim lengths.
        handle: per-sample backend locators (a list, or a dict of per-sample
            columns), indexed like any per-sample field.
        skeleton: the rest of a batch dataclass put with `put_batch` (type
            and shared values), to rebuild it with `get_batch`; else None.
    """

    backend: str
    partition: str
    sample_ids: list[str]
    fields: dict[str, FieldSpec]
    lengths: dict[str, list[int]] = field(default_factory=dict)
    handle: Any = None
    skeleton: Skeleton | None = None

    PER_SAMPLE = ("sample_ids", "lengths", "handle")

    def __len__(self) -> int:
        return len(self.sample_ids)

    @staticmethod
    def concat(parts: list[BatchMeta]) -> BatchMeta:
        """Concatenate metas of one partition and schema (e.g. gathered from ranks) in order."""
        if not parts:
            raise ValueError("cannot concatenate an empty list of metas")
        first = parts[0]
        for i, p in enumerate(parts[1:], 1):
            if (p.backend, p.partition, p.fields) != (first.backend, first.partition, first.fields):
                raise DataPlaneError(
                    f"cannot concatenate metas: part {i} is {p.backend}/{p.partition} with fields "
                    f"{sorted(p.fields)}, part 0 is {first.backend}/{first.partition} with {sorted(first.fields)}"
                )
        return batch_ops.concat(parts)


class DataPlaneStats:
    """Per-operation seconds, bytes and counts since the last `drain` (the observability hook)."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def record(self, op: str, seconds: float, num_bytes: int | None = None) -> None:
        values = {f"{op}_s": seconds, f"{op}_calls": 1.0}
        if num_bytes is not None:
            values[f"{op}_bytes"] = float(num_bytes)
        for key, v in values.items():
            self.totals[key] = self.totals.get(key, 0.0) + v

    def drain(self) -> dict[str, float]:
        """``{"dataplane/<op>_s"|"_bytes"|"_calls": total}`` since the last drain, then reset."""
        out = {f"dataplane/{k}": v for k, v in sorted(self.totals.items())}
        self.totals = {}
        return out


def merge_stats(parts: list[dict[str, float]]) -> dict[str, float]:
    """Sum `drain()` outputs of several processes (times add up across workers)."""
    out: dict[str, float] = {}
    for p in parts:
        for k, v in p.items():
            out[k] = out.get(k, 0.0) + v
    return out


class Transport(ABC):
    """A data-plane backend. One instance per process; the driver's instance bootstraps
    shared services (`start`), worker instances attach to them (`attach`).

    Subclasses set `name` and implement `_put(partition, ids, wire) -> handle`
    (wire: field name -> encoded value, see `codec.encode_field`),
    `_get(meta, names) -> {name: value}` and `_clear(partition)`.
    """

    name: ClassVar[str] = ""

    def __init__(self) -> None:
        self.device = torch.device("cpu")  # where `get` delivers tensors: the consuming process's device
        self.stats = DataPlaneStats()
        self._claims: dict[str, dict[str, set[str]]] = {}  # partition -> task -> sample ids

    # -- lifecycle --------------------------------------------------------------
    @classmethod
    def check_available(cls) -> None:
        """Raise ImportError naming the pip extra if the backend's package is missing."""
        return None

    def start(self) -> dict[str, Any]:
        """Driver side: bootstrap shared services; returns what workers need to `attach` (picklable)."""
        return {}

    def attach(self, info: dict[str, Any]) -> None:
        """Worker side: connect to the services the driver started."""
        return None

    def close(self) -> None:
        """Release this process's resources (the driver's close also stops shared services)."""
        return None

    # -- data -------------------------------------------------------------------
    def put(self, partition: str, sample_ids: list[str], fields: dict[str, Any]) -> BatchMeta:
        """Store per-sample `fields` of samples `sample_ids` in `partition`; returns their meta."""
        if not sample_ids:
            raise DataPlaneError(f"put into partition {partition!r}: empty batch")
        if len(set(sample_ids)) != len(sample_ids):
            raise DataPlaneError(f"put into partition {partition!r}: duplicate sample ids")
        specs = {name: spec_of(name, v, len(sample_ids)) for name, v in fields.items()}
        wire = {name: encode_field(fields[name], s) for name, s in specs.items()}
        lengths = {n: [int(t.shape[0]) for t in wire[n]] for n, s in specs.items() if s.kind == "jagged"}
        t0 = time.perf_counter()
        handle = self._put(partition, list(sample_ids), wire)
        self.stats.record("put", time.perf_counter() - t0, sum(nbytes(v) for v in wire.values()))
        return BatchMeta(self.name, partition, list(sample_ids), specs, lengths, handle)

    def get(self, meta: BatchMeta, fields: list[str] | None = None, jagged: str = "nested") -> dict[str, Any]:
        """Fetch `fields` (default: all) of the samples in `meta`, decoded (see `codec.decode_field`)
        onto `self.device`. Wire values are always host tensors (`put` moves them off the device)."""
        if meta.backend != self.name:
            raise DataPlaneError(
                f"meta of partition {meta.partition!r} was written by transport {meta.backend!r}, "
                f"not {self.name!r}"
            )
        names = list(meta.fields) if fields is None else list(fields)
        unknown = [n for n in names if n not in meta.fields]
        if unknown:
            raise DataPlaneError(
                f"partition {meta.partition!r} has no fields {unknown}; it has {sorted(meta.fields)}"
            )
        t0 = time.perf_counter()
        raw = self._get(meta, names)
        out = {n: decode_field(raw[n], meta.fields[n], n, jagged, self.device) for n in names}
        self.stats.record("get", time.perf_counter() - t0, sum(nbytes(v) for v in raw.values()))
        return out

    def claim(self, meta: BatchMeta, task: str) -> BatchMeta:
        """Driver side: hand the samples of `meta` to consumer `task`, exactly once.

        Raises DataPlaneError naming the samples if any was already claimed by
        `task` in this partition (clearing the partition resets its claims).
        """
        taken = self._claims.setdefault(meta.partition, {}).setdefault(task, set())
        again = [s for s in meta.sample_ids if s in taken]
        if again:
            raise DataPlaneError(
                f"task {task!r} already consumed samples {again[:4]}{'...' if len(again) > 4 else ''} "
                f"of partition {meta.partition!r}"
            )
        taken.update(meta.sample_ids)
        return meta

    def clear(self, partition: str) -> None:
        """Driver side: drop `partition` (all its samples and claims), also one a failed
        step left half-written. Idempotent."""
        t0 = time.perf_counter()
        self._clear(partition)
        self._claims.pop(partition, None)
        self.stats.record("clear", time.perf_counter() - t0)

    @abstractmethod
    def _put(self, partition: str, sample_ids: list[str], wire: dict[str, Any]) -> Any: ...

    @abstractmethod
    def _get(self, meta: BatchMeta, names: list[str]) -> dict[str, Any]: ...

    @abstractmethod
    def _clear(self, partition: str) -> None: ...


def _skeleton_to(skeleton: Skeleton, device: torch.device) -> Skeleton:
    """The skeleton with its shared tensors (e.g. a segment's pinned sigmas) on `device`."""
    shared = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in skeleton.shared.items()}
    children = {
        name: (how, _skeleton_to(where, device) if how == "batch" else where)
        for name, (how, where) in skeleton.children.items()
    }
    return Skeleton(skeleton.cls, shared, children)


def put_batch(transport: Transport, partition: str, obj: Any) -> BatchMeta:
    """Put batch dataclass `obj` (e.g. a `RolloutTrack`) keyed by its `sample_ids`; the meta keeps its
    skeleton, with its tensors on the CPU (a meta travels to the driver, which may have no GPU)."""
    fields, skeleton = flatten(obj)
    meta = transport.put(partition, list(obj.sample_ids), fields)
    meta.skeleton = _skeleton_to(skeleton, torch.device("cpu"))
    return meta


def get_batch(transport: Transport, meta: BatchMeta, fields: list[str] | None = None) -> Any:
    """Rebuild the batch dataclass of `meta` from its fields, every tensor on `transport.device`.

    With `fields` (a subset), the result is a partial view: the other
    per-sample fields are None (see `codec.unflatten`). A name may also be a
    nested batch (``segment``): it stands for all of that batch's fields.
    """
    if meta.skeleton is None:
        raise DataPlaneError(f"partition {meta.partition!r}: meta was not written by put_batch (no skeleton)")
    if fields is not None:
        fields = [
            f
            for name in fields
            for f in (
                [name]
                if name in meta.fields
                else sorted(k for k in meta.fields if k.startswith(name + ".")) or [name]
            )
        ]
    values = transport.get(meta, fields)
    return unflatten(_skeleton_to(meta.skeleton, transport.device), values, partial=fields is not None)
