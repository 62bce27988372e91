"""Worker groups on Ray: device pools, placements, rank info and dispatch modes."""

from unirl.distributed.group.cluster import init_ray
from unirl.distributed.group.device_pool import DevicePool, Placement, placement
from unirl.distributed.group.dispatch import DISPATCH_SPECS, Dispatch, DispatchSpec, dispatch, dispatch_mode
from unirl.distributed.group.local import LocalWorkerGroup, in_process
from unirl.distributed.group.rank import RankInfo
from unirl.distributed.group.remote import (
    PendingCall,
    Worker,
    WorkerError,
    WorkerGroup,
    free_port,
    remote,
    rendezvous,
)

__all__ = [
    "DISPATCH_SPECS",
    "DevicePool",
    "Dispatch",
    "DispatchSpec",
    "LocalWorkerGroup",
    "PendingCall",
    "Placement",
    "RankInfo",
    "Worker",
    "WorkerError",
    "WorkerGroup",
    "dispatch",
    "dispatch_mode",
    "free_port",
    "in_process",
    "init_ray",
    "placement",
    "remote",
    "rendezvous",
]
