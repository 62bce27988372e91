"""`broadcast`: buckets go over a torch.distributed group of trainer rank 0 and the engines.

The group is separate from the trainer's own (and from the engines'): the
sender opens a `TCPStore` on a free port of its node (`endpoint()` gives host,
port and world size), rank 0 is the sender and receiver i is rank i + 1. The
backend follows the device (`unirl.distributed.device.process_group_backend`):
gloo for CPU tensors, NCCL for CUDA ones. Per sync, in band: a header (magic,
version, plan digest, verify flag), then each bucket as one broadcast of its
frame (payload + checksum trailer), then in verify mode the tensor checksums.
Frames are packed on the sender's device and received into buffers on the
engine's, one bucket at a time: peak extra memory is one bucket per side.

`send` and `receive` are collectives: call them at the same time. A receiver
that dies or stops answering makes the sender's next broadcast fail within
`timeout_s` (a `WeightSyncError` naming the bucket), not hang.
Only gloo has run here (CPU); the NCCL path is the same code on CUDA buffers
and is untested in this repository.
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from unirl.distributed.device import process_group_backend
from unirl.sync.base import SyncTicket, WeightSyncReceiver, WeightSyncSender
from unirl.sync.frames import TRAILER, frame_capacity
from unirl.sync.plan import SyncPlan, WeightSyncError

MAGIC = 0x57_53_59_4E_43  # marks a header: a receiver out of step with its sender fails at once
_PREFIX = "unirl_weight_sync"


def _process_group(
    store: dist.Store, rank: int, size: int, device: torch.device, timeout: datetime.timedelta
) -> Any:
    """A process group of its own (not the default one) over `store`."""
    prefixed = dist.PrefixStore(_PREFIX, store)
    if process_group_backend(device) == "gloo":
        return dist.ProcessGroupGloo(prefixed, rank, size, timeout)
    nccl = getattr(dist, "ProcessGroupNCCL", None)
    if nccl is None:
        raise WeightSyncError(f"weight_sync.backend=broadcast on {device}: this torch build has no NCCL")
    torch.cuda.set_device(device)
    options = nccl.Options()
    options._timeout = timeout
    return nccl(prefixed, rank, size, options)


def node_address() -> str:
    """The address engines reach this process at: Ray's node IP inside Ray, else loopback."""
    import ray

    return ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"


class _Group:
    """The sync group as one side sees it: connect, broadcast from rank 0, shut down."""

    def __init__(self, device: torch.device, timeout_s: float) -> None:
        self.device = device
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.store: dist.Store | None = None
        self.pg: Any = None

    def join(self, rank: int, size: int) -> None:
        try:
            self.pg = _process_group(self.store, rank, size, self.device, self.timeout)
        except RuntimeError as exc:
            raise WeightSyncError(
                f"weight sync group (rank {rank} of {size}): could not connect within "
                f"{self.timeout.total_seconds():.0f} s: {exc}"
            ) from exc

    def broadcast(self, tensor: torch.Tensor, what: str) -> None:
        if self.pg is None:
            raise WeightSyncError(
                "the weight sync group is not connected: call connect() on every side first"
            )
        try:
            self.pg.broadcast(tensor, 0).wait()
        except RuntimeError as exc:
            raise WeightSyncError(
                f"weight sync broadcast of {what} failed (a peer died, or did not take part within "
                f"{self.timeout.total_seconds():.0f} s): {exc}"
            ) from exc

    def close(self) -> None:
        if self.pg is not None and hasattr(self.pg, "shutdown"):
            self.pg.shutdown()
        self.pg, self.store = None, None


class BroadcastSender(WeightSyncSender):
    """Trainer rank 0 of the sync group (root of every broadcast).

    Args:
        num_receivers: engines in the group (world size - 1).
        host: the address engines connect to (default: this node's, see `node_address`).
        timeout_s: how long a collective waits for the peers before failing.
    """

    backend = "broadcast"
    in_band = True

    def __init__(
        self,
        plan: SyncPlan,
        *,
        num_receivers: int = 1,
        host: str | None = None,
        timeout_s: float = 600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(plan, **kwargs)
        if num_receivers < 1:
            raise WeightSyncError(
                f"a broadcast sync needs at least one receiver, got num_receivers={num_receivers}"
            )
        self.world_size = num_receivers + 1
        self.group = _Group(self.device, timeout_s)
        self.host = host or node_address()
        if self.source:
            self.group.store = dist.TCPStore(
                self.host,
                0,
                self.world_size,
                is_master=True,
                wait_for_workers=False,
                timeout=self.group.timeout,
            )

    def endpoint(self) -> dict[str, Any] | None:
        if not self.source:
            return None
        return {"host": self.host, "port": self.group.store.port, "world_size": self.world_size}

    def connect(self) -> None:
        if self.source:
            self.group.join(0, self.world_size)

    def close(self) -> None:
        self.group.close()
        super().close()

    def _begin(self, ticket: SyncTicket) -> None:
        header = torch.tensor(
            [MAGIC, ticket.version, ticket.plan_digest, int(self.verify)], dtype=torch.int64
        )
        self.group.broadcast(header.to(self.device), f"the header of version {ticket.version}")

    def _put(self, ticket: SyncTicket, index: int, frame: torch.Tensor) -> None:
        self.group.broadcast(frame, f"bucket {index} of version {ticket.version}")

    def _end(self, ticket: SyncTicket) -> None:
        if ticket.piece_checksums is not None:
            self.group.broadcast(
                ticket.piece_checksums.to(self.device), f"the checksums of version {ticket.version}"
            )


class BroadcastReceiver(WeightSyncReceiver):
    """Engine `index` of the sync group (rank index + 1)."""

    backend = "broadcast"

    def __init__(
        self,
        plan: SyncPlan,
        endpoint: Mapping[str, Any] | None = None,
        index: int = 0,
        *,
        timeout_s: float = 600.0,
        **kwargs: Any,
    ) -> None:
        super().__init__(plan, endpoint, index, **kwargs)
        if not endpoint or not {"host", "port", "world_size"} <= set(endpoint):
            raise WeightSyncError(
                f"a broadcast receiver needs the sender's endpoint (host, port, world_size), got {endpoint!r}"
            )
        if not 0 <= index < endpoint["world_size"] - 1:
            raise WeightSyncError(
                f"receiver index {index} outside the group's {endpoint['world_size'] - 1} receivers"
            )
        self.group = _Group(self.device, timeout_s)
        self._staging: torch.Tensor | None = None

    def connect(self) -> None:
        ep = self.endpoint
        try:
            self.group.store = dist.TCPStore(
                ep["host"], ep["port"], ep["world_size"], is_master=False, timeout=self.group.timeout
            )
        except RuntimeError as exc:
            raise WeightSyncError(
                f"could not reach the weight sync sender at {ep['host']}:{ep['port']}: {exc}"
            ) from exc
        self.group.join(self.index + 1, ep["world_size"])

    def close(self) -> None:
        self.group.close()
        self._staging = None

    def _begin(self, ticket: SyncTicket | None) -> SyncTicket:
        header = torch.empty(4, dtype=torch.int64, device=self.device)
        self.group.broadcast(header, "the header")
        magic, version, digest, verify = header.tolist()
        if magic != MAGIC:
            raise WeightSyncError(f"weight sync stream out of step: expected a header, got {header.tolist()}")
        return SyncTicket(version, digest, piece_checksums=torch.empty(0) if verify else None)

    def _get(self, ticket: SyncTicket, index: int) -> torch.Tensor:
        if self._staging is None:  # one receive buffer, kept between syncs (each frame is unpacked first)
            self._staging = torch.empty(frame_capacity(self.plan), dtype=torch.uint8, device=self.device)
        frame = self._staging[: self.plan.bucket_sizes[index] + TRAILER]
        self.group.broadcast(frame, f"bucket {index} of version {ticket.version}")
        return frame

    def _end(self, ticket: SyncTicket) -> SyncTicket:
        if ticket.piece_checksums is not None:
            sums = torch.empty(len(self.plan.pieces), 3, dtype=torch.int64, device=self.device)
            self.group.broadcast(sums, f"the checksums of version {ticket.version}")
            ticket.piece_checksums = sums.cpu()
        return ticket
