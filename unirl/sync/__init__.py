"""Weight sync: trainer weights to dedicated rollout engines, behind one contract (see README.md here)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import torch

from unirl.sync.base import SyncTicket, WeightSyncReceiver, WeightSyncSender
from unirl.sync.config import BACKEND_NAMES, WeightSyncConfig, weight_sync_problems
from unirl.sync.frames import checksum, piece_checksums
from unirl.sync.plan import (
    SyncPlan,
    TensorSpec,
    WeightSyncError,
    bind,
    canonical_name,
    is_lora_name,
    select,
)

# backend name -> (sender class path, receiver class path); imported on use
BACKENDS: dict[str, tuple[str, str]] = {
    "object_store": (
        "unirl.sync.object_store.ObjectStoreSender",
        "unirl.sync.object_store.ObjectStoreReceiver",
    ),
    "broadcast": (
        "unirl.sync.broadcast.BroadcastSender",
        "unirl.sync.broadcast.BroadcastReceiver",
    ),
    "cuda_ipc": (
        "unirl.sync.cuda_ipc.CudaIPCSender",
        "unirl.sync.cuda_ipc.CudaIPCReceiver",
    ),
}


def _class(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def plan_for(module: torch.nn.Module, kind: str, cfg: WeightSyncConfig) -> SyncPlan:
    """The sync plan of the trainer's `module` for a `kind` ("full" | "lora") payload under `cfg`."""
    return SyncPlan.for_module(
        module, kind, wire_dtype=cfg.wire_torch_dtype, bucket_bytes=cfg.bucket_bytes, rename=cfg.rename_rules
    )


def make_sender(
    cfg: WeightSyncConfig,
    plan: SyncPlan,
    *,
    num_receivers: int = 1,
    device: torch.device | str = "cpu",
    source: bool = True,
) -> WeightSyncSender:
    """The sender of `cfg.backend` on a trainer rank (`source`: the rank that transmits, rank 0)."""
    cls = _class(BACKENDS[cfg.backend][0])
    kwargs: dict[str, Any] = {"verify": cfg.verify, "device": device, "source": source}
    if cfg.backend == "broadcast":
        kwargs.update(num_receivers=num_receivers, timeout_s=cfg.timeout_s)
    return cls(plan, **kwargs)


def make_receiver(
    cfg: WeightSyncConfig,
    plan: SyncPlan,
    endpoint: Mapping[str, Any] | None,
    index: int = 0,
    *,
    device: torch.device | str = "cpu",
) -> WeightSyncReceiver:
    """The receiver of `cfg.backend` on engine `index`, reaching the sender at `endpoint`."""
    cls = _class(BACKENDS[cfg.backend][1])
    kwargs: dict[str, Any] = {"device": device}
    if cfg.backend == "broadcast":
        kwargs["timeout_s"] = cfg.timeout_s
    return cls(plan, endpoint, index, **kwargs)


__all__ = [
    "BACKENDS",
    "BACKEND_NAMES",
    "SyncPlan",
    "SyncTicket",
    "TensorSpec",
    "WeightSyncConfig",
    "WeightSyncError",
    "WeightSyncReceiver",
    "WeightSyncSender",
    "bind",
    "canonical_name",
    "checksum",
    "is_lora_name",
    "make_receiver",
    "make_sender",
    "piece_checksums",
    "plan_for",
    "select",
    "weight_sync_problems",
]
