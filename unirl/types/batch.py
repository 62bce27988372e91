"""Per-sample indexing shared by every batch-shaped type.

Each batch dataclass names its per-sample fields in a class attribute
`PER_SAMPLE`. Such a field is a tensor whose first dim is the batch, a list of
length batch, a dict of those, or a nested batch dataclass. Every other field
(sigmas, step indices, configs) is shared by the whole batch and copied as is.
Tracks split by sample for data-parallel ranks and concatenate back in order
through these helpers; `SampleBatch` gives a batch dataclass them as methods.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def _index(value: Any, idx: list[int]) -> Any:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return value[torch.as_tensor(idx, dtype=torch.long)]
    if isinstance(value, list):
        return [value[i] for i in idx]
    if isinstance(value, dict):
        return {k: _index(v, idx) for k, v in value.items()}
    if hasattr(value, "PER_SAMPLE"):
        return select(value, idx)
    raise TypeError(f"cannot index per-sample field of type {type(value).__name__}")


def _concat(values: list[Any]) -> Any:
    first = values[0]
    nones = sum(v is None for v in values)
    if nones == len(values):
        return None
    if nones:
        raise ValueError("cannot concatenate a field that is set in some parts and None in others")
    if isinstance(first, torch.Tensor):
        return torch.cat(values, dim=0)
    if isinstance(first, list):
        return [x for part in values for x in part]
    if isinstance(first, dict):
        return {k: _concat([v[k] for v in values]) for k in first}
    if hasattr(first, "PER_SAMPLE"):
        return concat(values)
    raise TypeError(f"cannot concatenate per-sample field of type {type(first).__name__}")


def select(obj: T, idx: list[int]) -> T:
    """Copy of batch dataclass `obj` with its per-sample fields restricted to `idx`."""
    updates = {name: _index(getattr(obj, name), idx) for name in obj.PER_SAMPLE}
    return dataclasses.replace(obj, **updates)


def concat(parts: list[T]) -> T:
    """Concatenate batch dataclasses of one type along the sample dim, in order.

    Shared fields are taken from the first part.
    """
    if not parts:
        raise ValueError("cannot concatenate an empty list of batches")
    updates = {name: _concat([getattr(p, name) for p in parts]) for name in parts[0].PER_SAMPLE}
    return dataclasses.replace(parts[0], **updates)


def even_chunks(n: int, parts: int) -> list[list[int]]:
    """Split range(n) into `parts` equal contiguous chunks; raise unless it divides."""
    if parts < 1 or n % parts:
        raise ValueError(f"a batch of {n} samples does not split evenly over {parts} ranks")
    size = n // parts
    return [list(range(r * size, (r + 1) * size)) for r in range(parts)]


def split(obj: T, parts: int) -> list[T]:
    """Split a batch dataclass with `len(obj)` samples into `parts` equal chunks."""
    return [select(obj, idx) for idx in even_chunks(len(obj), parts)]


class SampleBatch:
    """`select`, `split` and `concat` as methods of a batch dataclass (one that names its
    per-sample fields in `PER_SAMPLE` and counts its samples with `len`)."""

    def select(self: T, idx: list[int]) -> T:
        """A copy with the per-sample fields restricted to `idx`."""
        return select(self, idx)

    def split(self: T, parts: int) -> list[T]:
        """`parts` contiguous equal shards by sample (data-parallel scatter)."""
        return split(self, parts)

    @staticmethod
    def concat(parts: list[T]) -> T:
        """Reassemble shards in order (data-parallel gather); shared fields from the first."""
        return concat(parts)
