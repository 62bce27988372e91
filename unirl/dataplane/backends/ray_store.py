"""`ray`: fields go to the Ray object store; metas carry object refs.

A producer `ray.put`s its batch once (it owns the object); the handle is, per
sample, the ref and the sample's row in it. A consumer fetches each distinct
ref once and takes its rows. Objects are reference counted by Ray: clearing
drops the driver's refs, and the object is freed when the last meta holding
it is gone (consumers drop theirs when their call returns).
"""

from __future__ import annotations

from typing import Any

import ray
import torch

from unirl.dataplane.transport import BatchMeta, Transport


class RayObjectStoreTransport(Transport):
    """Handle = per-sample list of (ObjectRef of the producer's wire dict, row)."""

    name = "ray"

    def _put(self, partition: str, sample_ids: list[str], wire: dict[str, Any]) -> Any:
        ref = ray.put(wire)
        return [(ref, row) for row in range(len(sample_ids))]

    def _get(self, meta: BatchMeta, names: list[str]) -> dict[str, Any]:
        refs = list(dict.fromkeys(ref for ref, _ in meta.handle))
        objects = dict(zip(refs, ray.get(refs), strict=True))
        runs: list[tuple[Any, list[int]]] = []  # consecutive samples of one ref
        for ref, row in meta.handle:
            if runs and runs[-1][0] == ref:
                runs[-1][1].append(row)
            else:
                runs.append((ref, [row]))
        out: dict[str, Any] = {}
        for n in names:
            pieces = []
            for ref, rows in runs:
                col = objects[ref][n]
                whole = rows == list(range(len(col)))
                if isinstance(col, torch.Tensor):
                    pieces.append(col if whole else col[torch.as_tensor(rows)])
                else:
                    pieces.append(col if whole else [col[r] for r in rows])
            if isinstance(pieces[0], torch.Tensor):
                out[n] = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
            else:
                out[n] = [x for p in pieces for x in p]
        return out

    def _clear(self, partition: str) -> None:
        """Nothing is stored outside the metas: the data goes when the driver drops them."""
