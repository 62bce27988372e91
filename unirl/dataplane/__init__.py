"""The data plane: rollout outputs move worker-to-worker by handle (see README.md here)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from unirl.dataplane.codec import FieldSpec, to_padded
from unirl.dataplane.transport import (
    BatchMeta,
    DataPlaneError,
    DataPlaneStats,
    Transport,
    get_batch,
    merge_stats,
    put_batch,
)

# name -> class path (imported on use: the TransferQueue ones need optional extras, which their
# `check_available` names)
TRANSPORTS: dict[str, str] = {
    "inband": "unirl.dataplane.backends.inband.InbandTransport",
    "ray": "unirl.dataplane.backends.ray_store.RayObjectStoreTransport",
    "tq_simple": "unirl.dataplane.backends.transfer_queue.TQSimpleTransport",
    "tq_mooncake": "unirl.dataplane.backends.transfer_queue.TQMooncakeTransport",
}


def transport_problems(cfg: Any) -> list[str]:
    """Problems with a `transport` recipe node (unknown name, missing optional extra), as messages."""
    if cfg is None or "name" not in cfg:
        return ["transport: missing; choose one with transport=<name> (" + ", ".join(TRANSPORTS) + ")"]
    name = cfg["name"]
    if name not in TRANSPORTS:
        return [f"transport.name: unknown transport {name!r}; choose one of {sorted(TRANSPORTS)}"]
    cls = _transport_class(name)
    try:
        cls.check_available()
    except ImportError as exc:
        return [f"transport={name}: {exc}"]
    try:  # constructors only check options; nothing starts before `start()`
        cls(**{k: v for k, v in dict(cfg).items() if k != "name"})
    except (TypeError, ValueError) as exc:
        return [f"transport ({name}): {exc}"]
    return []


def _transport_class(name: str) -> type[Transport]:
    module, _, cls = TRANSPORTS[name].rpartition(".")
    return getattr(importlib.import_module(module), cls)


def make_transport(cfg: Any, device: str | torch.device = "cpu") -> Transport:
    """The transport a recipe's `transport` node names ({name: ..., <options>}), delivering
    what it gets onto `device` (the consuming process's device)."""
    if cfg is None or cfg.get("name") not in TRANSPORTS:
        raise DataPlaneError("; ".join(transport_problems(cfg)))
    cls = _transport_class(cfg["name"])
    cls.check_available()
    transport = cls(**{k: v for k, v in dict(cfg).items() if k != "name"})
    transport.device = torch.device(device)
    return transport


__all__ = [
    "TRANSPORTS",
    "BatchMeta",
    "DataPlaneError",
    "DataPlaneStats",
    "FieldSpec",
    "Transport",
    "get_batch",
    "make_transport",
    "merge_stats",
    "put_batch",
    "to_padded",
    "transport_problems",
]
