"""The weight-sync contract: a sender on the trainer ranks, a receiver on each engine.

    trainer rank r                                  engine e
    sender = make_sender(cfg, plan, ...)            receiver = make_receiver(cfg, plan, sender.endpoint(), e)
    sender.connect()            (at once with)      receiver.connect()
    ticket = sender.send(module.named_parameters(), version)
                                                    receiver.receive(ticket, into=bind(module, plan))

`send` runs on every trainer rank (it gathers FSDP2 shards, a collective);
only the source rank (rank 0) transmits and returns a ticket. A ticket is
small (version, plan digest, per-bucket handles, verify checksums): the driver
passes it to every receiver. Backends whose bytes travel as a collective
(`in_band`, the broadcast) carry the ticket in band: their `send` and
`receive(None)` must run at the same time, and `send` returns once every
receiver has the bytes.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from unirl.sync.frames import frame_capacity, pack, piece_checksums, unpack
from unirl.sync.plan import SyncPlan, WeightSyncError, select


@dataclass
class SyncTicket:
    """What the driver hands from the sender to each receiver for one sync.

    Attributes:
        version: the sender's weight version (e.g. its optimizer step); a
            receiver accepts only versions above the last one it applied.
        plan_digest: `SyncPlan.digest` of the sender's plan.
        frames: per bucket, the backend's handle (an ObjectRef, a CUDA IPC
            handle); empty for in-band backends.
        piece_checksums: verify mode: int64 [len(plan.pieces), 3], every
            bucket's `piece_checksums` (its pieces at their wire dtype), computed
            by the sender from the frames it packed; None otherwise.
    """

    version: int
    plan_digest: int
    frames: list[Any] = field(default_factory=list)
    piece_checksums: torch.Tensor | None = None


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """A whole tensor from a plain tensor or an FSDP2 DTensor shard (all-gather: collective)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


class WeightSyncSender(ABC):
    """The trainer side of a sync backend (one per trainer rank).

    Args:
        plan: the sync plan (built from this trainer's module, `SyncPlan.for_module`).
        verify: checksum every piece of every packed frame and put the checksums on the
            ticket, so receivers check what landed in their tensors against the source.
        device: where frames are packed (backends that move host memory pack on the CPU).
        source: True on the rank that transmits (trainer rank 0); other ranks only
            join the gathers of sharded parameters.

    After each `send`, `stats` holds `sync/bytes` (wire bytes), `sync/buckets`,
    `sync/send_s` (wall time of the call) and `sync/version`.
    """

    backend: ClassVar[str] = ""
    in_band: ClassVar[bool] = False
    # frames are views of one staging buffer kept between syncs, safe when `_put` is done with a
    # frame when it returns (a copy or a blocking send); False: a fresh frame per bucket
    reuse_frames: ClassVar[bool] = True

    def __init__(
        self, plan: SyncPlan, *, verify: bool = False, device: torch.device | str = "cpu", source: bool = True
    ) -> None:
        self.plan = plan
        self.verify = verify
        self.device = torch.device(device)
        self.source = source
        self.stats: dict[str, float] = {}
        self._staging: torch.Tensor | None = None

    def endpoint(self) -> dict[str, Any] | None:
        """What receivers need to reach this sender (a small dict), or None."""
        return None

    def connect(self) -> None:
        """Join the transport (collective for in-band backends: at once with every receiver)."""
        return None

    def close(self) -> None:
        """Release the transport and anything held for receivers."""
        self._staging = None

    def send(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncTicket | None:
        """Send the plan's tensors out of `named_tensors` (e.g. `module.named_parameters()`:
        the plan's kind selects them, under canonical names). FSDP2 DTensors are gathered
        one at a time with `full_tensor()`, in plan order, on every rank (so every trainer
        rank must call `send`; each holds one whole tensor at a time).

        Returns the ticket on the source rank, None elsewhere.

        Raises:
            WeightSyncError: the tensors do not match the plan (missing, extra, shape,
                dtype; all listed) before anything is sent, or the transport failed.
        """
        start = time.perf_counter()
        found = select(named_tensors, self.plan.kind, self.plan.rename)
        problems = self.plan.mismatches(found, "trainer")
        if problems:
            raise WeightSyncError(
                f"the trainer's tensors do not match the {self.plan.kind} sync plan:\n  "
                + "\n  ".join(problems)
            )
        sources = [found[name] for name in self.plan.names]
        if not self.source:
            for tensor in sources:
                _full(tensor)
            return None
        sums: list[torch.Tensor] = []

        def fetch(index: int) -> torch.Tensor:
            return _full(sources[index]).detach()

        ticket = SyncTicket(version, self.plan.digest)
        self._begin(ticket)
        if self.reuse_frames and self._staging is None:  # kept between syncs: no fresh pages per sync
            self._staging = torch.empty(frame_capacity(self.plan), dtype=torch.uint8, device=self.device)
        staging = self._staging if self.reuse_frames else None
        for index, frame in enumerate(pack(self.plan, fetch, self.device, staging)):
            if self.verify:
                sums.append(piece_checksums(self.plan, index, frame).cpu())
            ticket.frames.append(self._put(ticket, index, frame))
        if self.verify:
            ticket.piece_checksums = torch.cat(sums)
        self._end(ticket)
        self.stats = {
            "sync/version": float(version),
            "sync/bytes": float(self.plan.wire_nbytes),
            "sync/buckets": float(len(self.plan.buckets)),
            "sync/send_s": time.perf_counter() - start,
        }
        return ticket

    # ---- backend hooks ------------------------------------------------------------------------
    def _begin(self, ticket: SyncTicket) -> None:
        """Before the first frame (in-band backends send the header)."""
        return None

    @abstractmethod
    def _put(self, ticket: SyncTicket, index: int, frame: torch.Tensor) -> Any:
        """Transmit frame `index`; return its handle for the ticket (or None)."""

    def _end(self, ticket: SyncTicket) -> None:
        """After the last frame (in-band backends send the verify checksums)."""
        return None


class WeightSyncReceiver(ABC):
    """The engine side of a sync backend (one per engine process).

    Args:
        plan: the sender's plan (as the driver handed it over).
        endpoint: `sender.endpoint()`.
        index: this receiver's index among the sender's receivers (0-based).
        device: where received tensors live (the engine's device).

    `version` is the last applied version (-1 before the first sync). After each
    `receive`, `stats` holds `sync/bytes`, `sync/receive_s` and `sync/version`.
    """

    backend: ClassVar[str] = ""

    def __init__(
        self,
        plan: SyncPlan,
        endpoint: Mapping[str, Any] | None = None,
        index: int = 0,
        *,
        device: torch.device | str = "cpu",
    ) -> None:
        self.plan = plan
        self.endpoint = endpoint
        self.index = index
        self.device = torch.device(device)
        self.version = -1
        self.stats: dict[str, float] = {}

    def connect(self) -> None:
        """Join the transport (collective for in-band backends: at once with the sender)."""
        return None

    def close(self) -> None:
        """Release the transport."""
        return None

    def receive(
        self, ticket: SyncTicket | None = None, into: Mapping[str, torch.Tensor] | None = None
    ) -> dict[str, torch.Tensor]:
        """Receive one sync into `into` ({canonical name: tensor}, e.g. `bind(module, plan)`:
        written in place) or into fresh tensors on `self.device`; returns them by name.

        `ticket`: the sender's ticket (None for in-band backends, which receive it in band).
        Every bucket is checked (size, checksum) before it is unpacked; in verify mode the
        received tensors are then packed again, after every bucket has landed, and every
        piece's checksum at its wire dtype is compared with the sender's (so a tensor
        overwritten after its bucket, e.g. two names aliasing one storage, is caught too). On an
        error `into` may be partly written and `version` does not advance: do not sample
        with those weights.

        Raises:
            WeightSyncError: a ticket from another plan or an old version; `into` not matching
                the plan; a corrupted bucket (all of them listed); verify mismatches (naming
                the tensors); the transport failed.
        """
        start = time.perf_counter()
        ticket = self._begin(ticket)
        if ticket.plan_digest != self.plan.digest:
            raise WeightSyncError(
                f"sync version {ticket.version} was built from another plan (digest {ticket.plan_digest}, "
                f"this engine's {self.plan.digest}): hand the engine the trainer's current plan"
            )
        if ticket.version <= self.version:
            raise WeightSyncError(
                f"sync version {ticket.version} is not newer than the engine's weights (version {self.version})"
            )
        if into is None:
            into = {
                t.name: torch.empty(t.shape, dtype=t.dtype, device=self.device) for t in self.plan.tensors
            }
        else:
            problems = self.plan.mismatches(into, "engine")
            problems += [f"{n}: not contiguous" for n, t in into.items() if not t.is_contiguous()]
            if problems:
                raise WeightSyncError(
                    "the receiving tensors do not match the sync plan:\n  " + "\n  ".join(problems)
                )
        dests = [into[name].view(-1) for name in self.plan.names]
        errors = []
        with torch.no_grad():
            for index in range(len(self.plan.buckets)):
                frame = self._get(ticket, index)
                try:
                    unpack(self.plan, index, frame, dests, ticket.version)
                except WeightSyncError as exc:  # keep draining: an in-band sender is still sending
                    errors.append(str(exc))
        ticket = self._end(ticket)
        if errors:
            raise WeightSyncError("\n".join(errors))
        if ticket.piece_checksums is not None:
            with torch.no_grad():
                got = torch.cat([
                    piece_checksums(self.plan, index, frame).cpu()
                    for index, frame in enumerate(pack(self.plan, lambda i: dests[i], self.device))
                ])  # fmt: skip
            pieces = self.plan.pieces
            if ticket.piece_checksums.shape != got.shape:
                raise WeightSyncError(
                    f"verify: sync version {ticket.version} carries {tuple(ticket.piece_checksums.shape)} "
                    f"checksums, the plan has {len(pieces)} pieces: the sender used another plan"
                )
            differs = (got != ticket.piece_checksums).any(dim=1).tolist()
            wrong = list(
                dict.fromkeys(
                    self.plan.names[p.tensor] for p, bad in zip(pieces, differs, strict=True) if bad
                )
            )
            if wrong:
                raise WeightSyncError(
                    f"verify: after sync version {ticket.version}, {len(wrong)} tensor(s) of the engine differ "
                    f"from the trainer's at the wire dtype: {', '.join(wrong[:8])}"
                )
        self.version = ticket.version
        self.stats = {
            "sync/version": float(ticket.version),
            "sync/bytes": float(self.plan.wire_nbytes),
            "sync/receive_s": time.perf_counter() - start,
        }
        return dict(into)

    # ---- backend hooks ------------------------------------------------------------------------
    def _begin(self, ticket: SyncTicket | None) -> SyncTicket:
        """The ticket to receive (in-band backends read the header); checks one was given."""
        if ticket is None:
            raise WeightSyncError(f"the {self.backend} receiver needs the sender's ticket (receive(ticket))")
        return ticket

    @abstractmethod
    def _get(self, ticket: SyncTicket, index: int) -> torch.Tensor:
        """Frame `index` as a 1-D uint8 tensor (read-only is fine)."""

    def _end(self, ticket: SyncTicket) -> SyncTicket:
        """After the last frame (in-band backends read the verify checksums)."""
        return ticket
