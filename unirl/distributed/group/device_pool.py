"""Ray placement groups as a pool of devices, and slabs of it for worker groups.

A device is one GPU when the pool uses GPUs and one CPU slot otherwise. A
`DevicePool` reserves all its devices at once in ONE placement group (strategy
PACK), one bundle per device. `placement(...)` names the bundles a worker group
occupies: groups built on the same `Placement` are colocated (their workers
share devices rank by rank).
"""

from __future__ import annotations

from dataclasses import dataclass

import ray
from ray.util.placement_group import (
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


class DevicePool:
    """`num_devices` devices reserved in one Ray placement group.

    Args:
        num_devices: number of bundles (devices) to reserve.
        cpus_per_device: logical CPUs reserved per bundle; every worker placed
            on a device takes a share of it.
        use_gpu: one GPU per bundle when True, CPU-only when False; None means
            "GPUs if Ray reports any".
        timeout_s: how long to wait for Ray to grant the reservation.

    Raises:
        RuntimeError: if Ray is not initialised, or the placement group is not
            ready within ``timeout_s`` (the message names ``num_devices`` and
            Ray's total/available resources). Nothing stays reserved then.

    Requires ``ray.init`` to have been called. Call `shutdown()` (or use the
    pool as a context manager) to release the reservation; workers placed on
    the pool should be shut down first.
    """

    def __init__(
        self,
        num_devices: int,
        cpus_per_device: float = 1.0,
        use_gpu: bool | None = None,
        *,
        timeout_s: float = 60.0,
    ) -> None:
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        if cpus_per_device <= 0:
            raise ValueError(f"cpus_per_device must be > 0, got {cpus_per_device}")
        if not ray.is_initialized():
            raise RuntimeError("DevicePool needs a running Ray cluster: call ray.init(...) first")
        if use_gpu is None:
            use_gpu = ray.cluster_resources().get("GPU", 0) > 0
        self.num_devices = num_devices
        self.cpus_per_device = float(cpus_per_device)
        self.is_gpu = bool(use_gpu)
        bundle: dict[str, float] = {"CPU": self.cpus_per_device}
        if self.is_gpu:
            bundle["GPU"] = 1.0
        self.bundle = bundle
        self._pg = placement_group([dict(bundle) for _ in range(num_devices)], strategy="PACK")
        ready, _ = ray.wait([self._pg.ready()], timeout=timeout_s)
        if not ready:
            remove_placement_group(self._pg)
            self._pg = None
            kind = "GPU" if self.is_gpu else "CPU-slot"
            raise RuntimeError(
                f"DevicePool could not reserve {num_devices} {kind} devices (bundle {bundle}, strategy PACK) "
                f"within {timeout_s:g}s. Ray has {_fmt(ray.cluster_resources())} in total and "
                f"{_fmt(ray.available_resources())} available. Lower num_devices (or cpus_per_device), "
                f"or start Ray with more resources."
            )

    @property
    def placement_group(self) -> PlacementGroup:
        """The underlying Ray placement group (raises once shut down)."""
        if self._pg is None:
            raise RuntimeError("DevicePool has been shut down")
        return self._pg

    def scheduling_strategy(self, bundle_index: int) -> PlacementGroupSchedulingStrategy:
        """Ray scheduling strategy that pins a task/actor to device `bundle_index`."""
        if not 0 <= bundle_index < self.num_devices:
            raise IndexError(f"bundle_index {bundle_index} outside [0, {self.num_devices})")
        return PlacementGroupSchedulingStrategy(
            placement_group=self.placement_group, placement_group_bundle_index=bundle_index
        )

    def bundle_node_ids(self) -> list[str]:
        """Ray node id hosting each bundle, indexed by bundle."""
        table = placement_group_table(self.placement_group)
        by_index = table.get("bundles_to_node_id", {})
        return [str(by_index.get(i, "")) for i in range(self.num_devices)]

    def shutdown(self) -> None:
        """Release the placement group. Idempotent."""
        if self._pg is not None:
            remove_placement_group(self._pg)
            self._pg = None

    def __enter__(self) -> DevicePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        kind = "gpu" if self.is_gpu else "cpu"
        return f"DevicePool(num_devices={self.num_devices}, {kind}, cpus_per_device={self.cpus_per_device:g})"


@dataclass(frozen=True)
class Placement:
    """The bundles (devices) of `pool` a worker group occupies; rank i sits on ``bundle_indices[i]``.

    Groups created on equal placements are colocated: they share the devices.
    """

    pool: DevicePool
    bundle_indices: tuple[int, ...]

    @property
    def world_size(self) -> int:
        """Number of workers a group on this placement has (one per device)."""
        return len(self.bundle_indices)


def placement(pool: DevicePool, num_workers: int | None = None, first_device: int = 0) -> Placement:
    """A contiguous slab of `num_workers` devices of `pool`, starting at `first_device`.

    ``num_workers=None`` takes every device from `first_device` on. Calling it
    twice with the same arguments gives the same slab (colocation); disjoint
    ``first_device`` ranges give separate slabs.
    """
    if num_workers is None:
        num_workers = pool.num_devices - first_device
    if num_workers < 1 or first_device < 0 or first_device + num_workers > pool.num_devices:
        raise ValueError(
            f"cannot place {num_workers} workers from device {first_device} on a pool of {pool.num_devices} devices"
        )
    return Placement(pool=pool, bundle_indices=tuple(range(first_device, first_device + num_workers)))


def _fmt(resources: dict[str, float]) -> str:
    """Resources a user asked for (CPU, GPU, custom), without node/placement-group/memory bookkeeping."""
    skip = ("node:", "bundle_group", "memory", "object_store")
    keep = {k: v for k, v in resources.items() if not k.startswith(skip) and "_group_" not in k}
    return "{" + ", ".join(f"{k}: {v:g}" for k, v in sorted(keep.items())) + "}"
