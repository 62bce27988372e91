"""`object_store`: buckets go through the Ray object store; the ticket carries their refs.

The sender packs each bucket on the CPU and `ray.put`s it (the sender's process
owns the objects); the ticket's refs keep them alive until the driver drops the
ticket. A receiver `ray.get`s each bucket zero-copy from shared memory (or
pulled from the sender's node), checks it, and copies the pieces straight into
its tensors (one copy; one more to the engine's GPU when it has one).
Works across nodes, needs no rendezvous, and does not block the sender on
slow engines. Peak object-store use: the whole payload at the wire dtype.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import ray
import torch

from unirl.sync.base import SyncTicket, WeightSyncReceiver, WeightSyncSender
from unirl.sync.plan import SyncPlan, WeightSyncError


def _require_ray(role: str) -> None:
    if not ray.is_initialized():
        raise WeightSyncError(
            f"weight_sync.backend=object_store: the {role} runs outside Ray (ray.is_initialized() is False); "
            "run trainer and engines as Ray workers, or choose backend broadcast"
        )


class ObjectStoreSender(WeightSyncSender):
    """Puts every bucket into the Ray object store; the ticket's `frames` are their ObjectRefs."""

    backend = "object_store"

    def __init__(self, plan: SyncPlan, **kwargs: Any) -> None:
        kwargs["device"] = "cpu"  # packed straight into host memory, whatever the trainer's device
        super().__init__(plan, **kwargs)
        if self.source:
            _require_ray("sender")

    def _put(self, ticket: SyncTicket, index: int, frame: torch.Tensor) -> Any:
        return ray.put(frame.numpy())


class ObjectStoreReceiver(WeightSyncReceiver):
    """Reads each bucket of the ticket from the Ray object store."""

    backend = "object_store"

    def __init__(self, plan: SyncPlan, *args: Any, **kwargs: Any) -> None:
        super().__init__(plan, *args, **kwargs)
        _require_ray("receiver")

    def _get(self, ticket: SyncTicket, index: int) -> torch.Tensor:
        if len(ticket.frames) != len(self.plan.buckets):
            raise WeightSyncError(
                f"sync version {ticket.version}: the ticket holds {len(ticket.frames)} buckets, "
                f"the plan {len(self.plan.buckets)}"
            )
        array: np.ndarray = ray.get(ticket.frames[index])
        with warnings.catch_warnings():  # a read-only zero-copy view: only read from
            warnings.simplefilter("ignore", UserWarning)
            frame = torch.from_numpy(array)
        return frame.to(self.device) if self.device.type != "cpu" else frame
