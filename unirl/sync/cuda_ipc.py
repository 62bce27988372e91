"""`cuda_ipc`: colocated engines read the trainer's packed buckets through CUDA IPC handles.

For `placement: colocate`, where the trainer rank and its engine share one
GPU. The sender packs each bucket on its GPU and puts a CUDA IPC handle of
it (`torch.multiprocessing.reductions.reduce_tensor`) on the ticket, with the
GPU's UUID; the receiver maps the UUID to its own device index (processes
may see the GPU under different indices), opens the handle, checks the
bucket and copies the pieces into its tensors, GPU to GPU. The sender keeps
the buckets alive until its next `send` or `close` (peak: the whole payload
at the wire dtype on the GPU), so the driver must let every receiver finish
before the next sync (the sequential loop does).

Ran on one H200 (tests/sync/test_gpu.py: two processes on one GPU, bit-exact at the
wire dtype; docs/results/devices.md); not yet inside a Ray run on a GPU. Without CUDA,
constructing either side raises a `WeightSyncError`, and recipe validation refuses the backend
off GPUs and outside colocated placement (`weight_sync_problems`).
"""

from __future__ import annotations

from typing import Any

import torch

from unirl.sync.base import SyncTicket, WeightSyncReceiver, WeightSyncSender
from unirl.sync.plan import SyncPlan, WeightSyncError

_DEVICE_ARG = 6  # position of the device index in rebuild_cuda_tensor's arguments


def require_cuda(device: torch.device, role: str) -> None:
    """Raise unless `device` is a CUDA device this process can use."""
    if device.type != "cuda" or not torch.cuda.is_available():
        raise WeightSyncError(
            f"weight_sync.backend=cuda_ipc: the {role} is on {device} and torch "
            f"{torch.__version__} sees {'no' if not torch.cuda.is_available() else 'a'} CUDA device; "
            "CUDA IPC shares GPU memory between processes on one GPU (placement: colocate). "
            "Use backend broadcast or object_store on CPUs or across GPUs"
        )


def _uuid(device: torch.device) -> str:
    return str(torch.cuda.get_device_properties(device).uuid)


class CudaIPCSender(WeightSyncSender):
    """Packs buckets on the trainer's GPU; the ticket's `frames` are (IPC handle, GPU UUID) pairs."""

    backend = "cuda_ipc"
    reuse_frames = False  # receivers read the frames after send returns

    def __init__(self, plan: SyncPlan, **kwargs: Any) -> None:
        super().__init__(plan, **kwargs)
        if self.source:
            require_cuda(self.device, "sender")
        self._held: list[torch.Tensor] = []

    def send(self, named_tensors: Any, version: int) -> SyncTicket | None:
        self.close()  # the previous sync's buckets: every receiver has finished with them
        ticket = super().send(named_tensors, version)
        if self.source:
            torch.cuda.current_stream(self.device).synchronize()  # buckets written before anyone reads
        return ticket

    def _put(self, ticket: SyncTicket, index: int, frame: torch.Tensor) -> Any:
        from torch.multiprocessing.reductions import reduce_tensor

        self._held.append(frame)
        return reduce_tensor(frame), _uuid(self.device)

    def close(self) -> None:
        if self._held:
            self._held.clear()
            torch.cuda.ipc_collect()


class CudaIPCReceiver(WeightSyncReceiver):
    """Opens the sender's buckets on the shared GPU."""

    backend = "cuda_ipc"

    def __init__(self, plan: SyncPlan, *args: Any, **kwargs: Any) -> None:
        super().__init__(plan, *args, **kwargs)
        require_cuda(self.device, "receiver")

    def _get(self, ticket: SyncTicket, index: int) -> torch.Tensor:
        (rebuild, args), uuid = ticket.frames[index]
        local = [i for i in range(torch.cuda.device_count()) if _uuid(torch.device("cuda", i)) == uuid]
        if not local:
            raise WeightSyncError(
                f"cuda_ipc: the trainer's GPU {uuid} is not visible to this engine; cuda_ipc needs "
                "trainer and engine on the same GPU (placement: colocate)"
            )
        args = list(args)
        args[_DEVICE_ARG] = local[0]
        return rebuild(*args)
