"""`ray`: fields go to the Ray object store; metas carry object refs.

A producer `ray.put`s its batch once (it owns the object); the handle is, per
sample, the ref and the sample's row in it. Tensors are stored as numpy
arrays (bf16 and other dtypes numpy lacks as same-width integer views), which
Ray reads back zero-copy from shared memory; a consumer fetches each distinct
ref once and copies out only its rows (one copy, into memory it owns: the
shared buffers are read-only). Objects are reference counted by Ray: the
object is freed when the last meta holding its ref is dropped (the driver
drops its metas when the step ends; consumers when their call returns).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import ray
import torch

from unirl.dataplane.transport import BatchMeta, Transport

# dtypes numpy has no type for travel as integer views of the same width
_VIEW_AS = {torch.bfloat16: torch.int16, torch.float8_e4m3fn: torch.int8, torch.float8_e5m2: torch.int8}


def _to_shared(t: torch.Tensor) -> tuple[np.ndarray, torch.dtype]:
    view = _VIEW_AS.get(t.dtype)
    return (t.view(view) if view is not None else t).numpy(), t.dtype


def _from_shared(arr: np.ndarray, dtype: torch.dtype, rows: list[int] | None) -> torch.Tensor:
    with warnings.catch_warnings():  # a read-only zero-copy view; we copy out of it right away
        warnings.simplefilter("ignore", UserWarning)
        t = torch.from_numpy(arr)
    t = t[torch.as_tensor(rows)] if rows is not None else t.clone()
    return t.view(dtype) if dtype in _VIEW_AS else t


class RayObjectStoreTransport(Transport):
    """Handle = per-sample list of (ObjectRef of the producer's batch, row)."""

    name = "ray"

    def _put(self, partition: str, sample_ids: list[str], wire: dict[str, Any]) -> Any:
        stored = {}
        for n, v in wire.items():
            if isinstance(v, torch.Tensor):
                stored[n] = ("dense", *_to_shared(v))
            elif v and isinstance(v[0], torch.Tensor):
                stored[n] = ("jagged", [_to_shared(t) for t in v])
            else:
                stored[n] = ("object", v)
        ref = ray.put(stored)
        return [(ref, row) for row in range(len(sample_ids))]

    def _get(self, meta: BatchMeta, names: list[str]) -> dict[str, Any]:
        refs = list(dict.fromkeys(ref for ref, _ in meta.handle))
        objects = dict(zip(refs, ray.get(refs), strict=True))
        runs: list[tuple[Any, list[int]]] = []  # consecutive samples from one ref
        for ref, row in meta.handle:
            if runs and runs[-1][0] == ref:
                runs[-1][1].append(row)
            else:
                runs.append((ref, [row]))
        out: dict[str, Any] = {}
        for n in names:
            pieces: list[Any] = []
            for ref, rows in runs:
                kind, *payload = objects[ref][n]
                if kind == "dense":
                    arr, dtype = payload
                    whole = rows == list(range(arr.shape[0]))
                    pieces.append(_from_shared(arr, dtype, None if whole else rows))
                elif kind == "jagged":
                    pieces.append([_from_shared(*payload[0][r], None) for r in rows])
                else:
                    pieces.append([payload[0][r] for r in rows])
            if isinstance(pieces[0], torch.Tensor):
                out[n] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            else:
                out[n] = [x for p in pieces for x in p]
        return out

    def _clear(self, partition: str) -> None:
        """Nothing is stored outside the metas: the objects go when the driver drops them."""
