"""Buckets on the wire: packing tensors into flat byte frames, checking and unpacking them.

A frame is one bucket of a `SyncPlan`: a 1-D uint8 tensor of
`plan.bucket_sizes[i]` payload bytes (each piece at its planned offset, in its
wire dtype, gaps zeroed) followed by a 24-byte trailer (`TRAILER`: three int64),
the `checksum` of the payload. The same code packs on CPU or GPU and unpacks from a Ray
shared-memory buffer, a broadcast buffer or a CUDA IPC handle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

import torch

from unirl.sync.plan import SyncPlan, WeightSyncError

TRAILER = 24  # three int64: the payload's checksum
_ROW = 1024  # words per row of the checksum's word matrix


def checksum(data: torch.Tensor) -> torch.Tensor:
    """An exact checksum of bytes: int64 [3] on `data`'s device.

    `data` is 1-D uint8 whose storage offset is a multiple of 8. Its bytes are
    read as little-endian int64 words (a short tail zero-padded to one word),
    laid out as rows of 1024 words; with row sums r_i and column sums c_j the
    result is (sum_i r_i, sum_i (2i + 1) r_i, sum_j (2j + 1) c_j), all mod 2^64
    in two's complement (torch's int64 kernels wrap). The plain sum changes
    with any single changed word or flipped bit; the odd weights (invertible
    mod 2^64) change with words swapped or shifted between rows (second) or
    within a row (third). Equal bytes give equal sums on every device and
    thread count (modular sums do not depend on order). Cost: two passes over
    the bytes (row and column sums), about 2.4 GB/s on one CPU thread.
    """
    n = data.numel()
    whole = n - n % 8
    words = data[:whole].view(torch.int64)
    full = words.numel() // _ROW * _ROW
    body = words[:full].view(-1, _ROW)
    rows, cols = body.sum(dim=1), body.sum(dim=0)
    rest = words[full:]
    if whole < n:
        tail = torch.zeros(8, dtype=torch.uint8, device=data.device)
        tail[: n - whole] = data[whole:]
        rest = torch.cat([rest, tail.view(torch.int64)])
    if rest.numel():  # the last, short row (at most _ROW words: fewer than _ROW + the tail word)
        rows = torch.cat([rows, rest.sum().view(1)])
        cols[: rest.numel()] += rest

    def odd(k: int) -> torch.Tensor:
        return torch.arange(k, dtype=torch.int64, device=data.device) * 2 + 1

    return torch.stack([rows.sum(), (rows * odd(rows.numel())).sum(), (cols * odd(_ROW)).sum()])


def piece_checksums(plan: SyncPlan, index: int, frame: torch.Tensor) -> torch.Tensor:
    """A checksum of every piece of frame `index`, from prefix sums over the frame: int64
    [len(plan.buckets[index]), 3] on the frame's device. What verify mode compares.

    With piece p's bytes read as little-endian int64 words w_0 .. w_{n-1} (a short tail
    zero-padded), its checksum is (sum_k w_k, sum_k (2k + 1) w_k, sum_k k^2 w_k), mod 2^64 in
    two's complement. The first sum changes with any changed word, the other two with words
    swapped or shifted within the piece. A piece starts on an `ALIGN`-byte boundary and the
    frame's gaps are zero (`pack` zeroes them), so with the frame's word index j = s_p + k all
    three follow from prefix sums of w_j, j w_j and j^2 w_j taken at the pieces' first words:
    three cumulative sums over the frame, however many tensors it holds (a checksum call per
    tensor costs about 70 us of fixed overhead). Memory: a few int64 temporaries of 2^16 words.
    """
    pieces = plan.buckets[index]
    words = frame[: plan.bucket_sizes[index]].view(torch.int64)
    device, n = frame.device, words.numel()
    starts = torch.tensor([p.offset // 8 for p in pieces], dtype=torch.int64, device=device)
    bounds = torch.cat([starts, torch.tensor([n], dtype=torch.int64, device=device)])
    prefix = torch.zeros(len(bounds), 3, dtype=torch.int64, device=device)  # sums over words < bound
    carry = torch.zeros(3, dtype=torch.int64, device=device)
    chunk = 1 << 16  # 512 KB temporaries: fresh larger ones cost page faults (2^20: 8x slower)
    for lo in range(0, n, chunk):
        w = words[lo : lo + chunk]
        j = torch.arange(lo, lo + w.numel(), dtype=torch.int64, device=device)
        jw = j * w
        inside = (bounds > lo) & (bounds <= lo + w.numel())
        at = bounds[inside] - lo - 1
        for term, values in enumerate((w, jw, j * jw)):
            sums = values.cumsum(dim=0)
            prefix[inside, term] = sums[at] + carry[term]
            carry[term] += sums[-1]
    s0, s1, s2 = (prefix[1:] - prefix[:-1]).unbind(dim=1)  # sums of w_j, j w_j, j^2 w_j per piece
    return torch.stack([s0, 2 * (s1 - starts * s0) + s0, s2 - 2 * starts * s1 + starts * starts * s0], dim=1)


def pack(
    plan: SyncPlan,
    fetch: Callable[[int], torch.Tensor],
    device: torch.device,
    staging: torch.Tensor | None = None,
) -> Iterator[torch.Tensor]:
    """Yield the plan's frames, one at a time, on `device`.

    `fetch(i)` returns tensor i of the plan (any device, any layout); it is
    called once per tensor, in plan order, and the tensor is dropped after its
    last piece is packed: peak memory is one frame plus one fetched tensor.
    Floating tensors are cast to the wire dtype while being copied in.
    `staging`: a uint8 buffer of at least `frame_capacity(plan)` bytes that
    every frame is a view of (the consumer must be done with a frame before
    asking for the next); None: a fresh allocation per frame.
    """
    current, flat = -1, torch.empty(0)
    for index, pieces in enumerate(plan.buckets):
        size = plan.bucket_sizes[index]
        if staging is None:
            frame = torch.empty(size + TRAILER, dtype=torch.uint8, device=device)
        else:
            frame = staging[: size + TRAILER]
        cursor = 0
        for piece in pieces:
            if piece.tensor != current:
                current, flat = piece.tensor, fetch(piece.tensor).detach().reshape(-1)
            wire = plan.wire_of(piece.tensor)
            if piece.offset > cursor:
                frame[cursor : piece.offset].zero_()
            end = piece.offset + piece.count * wire.itemsize
            frame[piece.offset : end].view(wire).copy_(flat[piece.start : piece.start + piece.count])
            cursor = end
        frame[cursor:size].zero_()
        frame[size:].view(torch.int64).copy_(checksum(frame[:size]))
        yield frame


def frame_capacity(plan: SyncPlan) -> int:
    """Bytes of the largest frame of `plan` (payload and trailer)."""
    return max(plan.bucket_sizes) + TRAILER


def unpack(
    plan: SyncPlan, index: int, frame: torch.Tensor, dests: Sequence[torch.Tensor], version: int
) -> None:
    """Check frame `index` against its trailer, then copy its pieces into `dests`
    (flat, contiguous 1-D views of the plan's tensors, by plan index), casting
    each from its wire dtype to the destination's dtype.

    Raises:
        WeightSyncError: the frame has the wrong size, or its checksum differs from
            the sender's (naming the bucket, the sync version and the tensors it holds).
    """
    size = plan.bucket_sizes[index]
    if frame.numel() != size + TRAILER:
        raise WeightSyncError(
            f"bucket {index} of version {version}: {frame.numel()} bytes arrived, the plan says {size + TRAILER}"
        )
    sent = frame[size:].view(torch.int64).cpu()
    got = checksum(frame[:size]).cpu()
    if not torch.equal(sent, got):
        raise WeightSyncError(
            f"bucket {index} of version {version} arrived corrupted (checksum {got.tolist()}, sender's "
            f"{sent.tolist()}); it holds {', '.join(plan.bucket_tensors(index))}"
        )
    for piece in plan.buckets[index]:
        wire = plan.wire_of(piece.tensor)
        src = frame[piece.offset : piece.offset + piece.count * wire.itemsize].view(wire)
        dests[piece.tensor][piece.start : piece.start + piece.count].copy_(src)
