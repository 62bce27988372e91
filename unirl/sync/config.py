"""The `weight_sync:` recipe block and the rules the recipe validator applies to it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch

from unirl.sync.plan import ALIGN, WIRE_DTYPES

BACKEND_NAMES = ("object_store", "broadcast", "cuda_ipc")


@dataclass
class WeightSyncConfig:
    """How a trainer sends its weights to a dedicated rollout engine.

    Attributes:
        backend: "object_store" (Ray object store buckets; any placement),
            "broadcast" (a torch.distributed group of trainer rank 0 and the
            engines: gloo on CPU, NCCL on GPU) or "cuda_ipc" (colocated GPUs
            only; its test passed on an H200).
        bucket_mb: capacity of one bucket in MiB (a tensor larger than a bucket
            is split between buckets). Bounds the sender's and the broadcast
            receiver's staging memory and is the unit of checksums.
        wire_dtype: null (each tensor in its own dtype, bit-exact), "float32"
            or "bfloat16" (floating tensors travel in it and are cast back).
        verify: after every sync each engine checksums every received tensor
            at the wire dtype and compares with the trainer's (one more pass
            over the weights on both sides).
        timeout_s: how long a broadcast waits for its peers before failing.
        rename: extra `[regex, replacement]` rules mapping parameter names to
            the names both sides share (applied after the built-in rules that
            drop wrapper segments, peft's `base_model.model.` and adapter names).
    """

    backend: str
    bucket_mb: float = 64.0
    wire_dtype: str | None = None
    verify: bool = False
    timeout_s: float = 600.0
    rename: list[list[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if isinstance(self.backend, (list, tuple)) or self.backend not in BACKEND_NAMES:
            raise ValueError(
                f"weight_sync.backend must be exactly one of {list(BACKEND_NAMES)}, got {self.backend!r}"
            )
        if not self.bucket_mb > 0 or self.bucket_bytes < ALIGN:
            raise ValueError(
                f"weight_sync.bucket_mb must be > 0 (at least {ALIGN} bytes), got {self.bucket_mb}"
            )
        if self.wire_dtype is not None and self.wire_dtype not in WIRE_DTYPES:
            raise ValueError(
                f"weight_sync.wire_dtype must be null or one of {sorted(WIRE_DTYPES)}, got {self.wire_dtype!r}"
            )
        if not self.timeout_s > 0:
            raise ValueError(f"weight_sync.timeout_s must be > 0, got {self.timeout_s}")
        for i, rule in enumerate(self.rename):
            if not (
                isinstance(rule, (list, tuple)) and len(rule) == 2 and all(isinstance(s, str) for s in rule)
            ):
                raise ValueError(f"weight_sync.rename[{i}] must be [regex, replacement], got {rule!r}")
            try:
                re.compile(rule[0])
            except re.error as exc:
                raise ValueError(f"weight_sync.rename[{i}]: bad regex {rule[0]!r}: {exc}") from exc

    @property
    def bucket_bytes(self) -> int:
        """`bucket_mb` in bytes, rounded down to a multiple of the piece alignment."""
        return int(self.bucket_mb * (1 << 20)) // ALIGN * ALIGN

    @property
    def wire_torch_dtype(self) -> torch.dtype | None:
        return None if self.wire_dtype is None else WIRE_DTYPES[self.wire_dtype]

    @property
    def rename_rules(self) -> tuple[tuple[str, str], ...]:
        return tuple((str(a), str(b)) for a, b in self.rename)


def weight_sync_problems(
    node: Any, *, dedicated: bool, placement: str | None = None, device_type: str = "cpu"
) -> list[str]:
    """Problems of a recipe's `weight_sync` node for its rollout engine, as messages.

    Args:
        node: the recipe's `weight_sync` mapping, or None when the recipe has none.
        dedicated: True for an engine with its own weights (fed by weight sync),
            False for the trainside engine (it samples with the trained module).
        placement: the dedicated engine's placement, "colocate" or "separate".
        device_type: "cuda" or "cpu", where the workers run.

    Rules: a dedicated engine needs exactly one sync backend; trainside has none;
    `cuda_ipc` needs GPUs and colocated placement; the block itself must be a valid
    `WeightSyncConfig`.
    """
    if not dedicated:
        if node is not None:
            return [
                "weight_sync: the trainside engine samples with the trained module itself, so there is "
                "nothing to sync; remove the weight_sync block (or use a dedicated engine)"
            ]
        return []
    if node is None:
        return [
            f"weight_sync: a dedicated rollout engine needs one sync backend: weight_sync.backend: one of {list(BACKEND_NAMES)}"
        ]
    if not isinstance(node, dict):
        return [f"weight_sync: expected a mapping (backend, bucket_mb, wire_dtype, verify), got {node!r}"]
    try:
        cfg = WeightSyncConfig(**node)
    except TypeError as exc:
        return [f"weight_sync: {exc} (keys: backend, bucket_mb, wire_dtype, verify, timeout_s, rename)"]
    except ValueError as exc:
        return [str(exc)]
    problems = []
    if cfg.backend == "cuda_ipc":
        if placement != "colocate":
            problems.append(
                f"weight_sync.backend=cuda_ipc needs the engine colocated with the trainer (placement: colocate), "
                f"got placement {placement!r}; use broadcast or object_store"
            )
        if device_type != "cuda":
            problems.append(
                f"weight_sync.backend=cuda_ipc needs GPUs; this run's workers are on {device_type}"
            )
    return problems
