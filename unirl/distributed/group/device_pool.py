"""Ray placement groups as a pool of devices, and slabs of it for worker groups.

A device is one GPU when the pool uses GPUs and one CPU slot otherwise; each
device is one placement-group bundle. Two layouts:

- single node (``devices_per_node=None`` and some alive node is big enough for
  every device): ONE placement group (strategy PACK), as before;
- multi-node (``devices_per_node`` given, or no single node is big enough): ONE
  placement group PER NODE (strategy STRICT_PACK, pinned to that node through
  Ray's ``ray.io/node-id`` label). Nodes are taken in order of (node IP, node
  id) and bundles, hence ranks, are numbered node by node: node k of the pool
  hosts a contiguous block of bundle indices, so with a uniform layout rank r
  lives on node ``r // devices_per_node``.

`placement(...)` names the bundles a worker group occupies: groups built on
the same `Placement` are colocated (their workers share devices rank by rank).
"""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass
from typing import Any

import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy


@dataclass(frozen=True)
class NodeSlots:
    """An alive Ray node and how many pool devices (bundles) it can hold in total."""

    node_id: str
    ip: str
    capacity: int
    resources: dict[str, float]


def alive_nodes(bundle: dict[str, float]) -> list[NodeSlots]:
    """Alive Ray nodes ordered by (node IP, node id), with their capacity for `bundle`.

    Capacity counts the node's TOTAL resources (``ray.nodes()``), not what is
    free right now: ``min over resources r of floor(node[r] / bundle[r])``.
    """
    nodes = []
    for info in ray.nodes():
        if not info.get("Alive"):
            continue
        res = {k: float(v) for k, v in (info.get("Resources") or {}).items()}
        cap = min(math.floor(res.get(k, 0.0) / v + 1e-9) for k, v in bundle.items())
        nodes.append(NodeSlots(str(info["NodeID"]), str(info["NodeManagerAddress"]), int(cap), res))
    return sorted(nodes, key=lambda n: (_ip_key(n.ip), n.node_id))


def node_ip(node_id: str) -> str:
    """IP address (``NodeManagerAddress``) of the Ray node `node_id`, from Ray's node table."""
    for info in ray.nodes():
        if str(info.get("NodeID")) == node_id:
            return str(info["NodeManagerAddress"])
    raise RuntimeError(f"Ray node {node_id} is not in the node table")


class DevicePool:
    """`num_devices` devices reserved as Ray placement-group bundles, on one node or spread over nodes.

    Args:
        num_devices: number of bundles (devices) to reserve.
        cpus_per_device: logical CPUs reserved per bundle; every worker placed
            on a device takes a share of it.
        use_gpu: one GPU per bundle when True, CPU-only when False; None means
            "GPUs if Ray reports any".
        devices_per_node: devices per node for the multi-node layout (the last
            node may get fewer when it does not divide `num_devices`). None:
            single placement group if some alive node can hold every device,
            otherwise inferred by filling alive nodes in (IP, id) order up to
            each node's CPU (or GPU) capacity; `devices_per_node` is then the
            first node's share.
        timeout_s: how long to wait for Ray to grant the reservation.

    Layout contract: bundle (= rank on a full placement) indices are ordered by
    node; node k of the pool holds bundles
    ``sum(node_device_counts[:k]) ... sum(node_device_counts[:k+1]) - 1``, so
    with a uniform layout bundle r is on node ``r // devices_per_node``. In the
    multi-node layout every node gets its own STRICT_PACK placement group
    pinned to it; nodes too small for their share are skipped.
    `scheduling_strategy(i)` takes the global bundle index.

    Raises:
        ValueError: on non-positive sizes.
        RuntimeError: if Ray is not initialised, if the alive nodes cannot hold
            the layout (raised at once), or if the placement groups are not
            ready within ``timeout_s``. The message names ``num_devices``,
            ``devices_per_node`` and the cluster's per-node capacity and
            total/available resources. Nothing stays reserved then.

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
        devices_per_node: int | None = None,
        timeout_s: float = 60.0,
    ) -> None:
        if num_devices < 1:
            raise ValueError(f"num_devices must be >= 1, got {num_devices}")
        if cpus_per_device <= 0:
            raise ValueError(f"cpus_per_device must be > 0, got {cpus_per_device}")
        if devices_per_node is not None and devices_per_node < 1:
            raise ValueError(f"devices_per_node must be >= 1 or None, got {devices_per_node}")
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
        self._pgs: list[PlacementGroup] = []
        self._offsets: list[int] = []
        self._requested_per_node = devices_per_node
        nodes = alive_nodes(bundle)
        if devices_per_node is None and any(n.capacity >= num_devices for n in nodes):
            self.multi_node = False
            self.devices_per_node = num_devices
            self._reserve([(None, num_devices)], "PACK", nodes, timeout_s)
        else:
            self.multi_node = True
            layout = self._layout(nodes, devices_per_node)
            self.devices_per_node = devices_per_node if devices_per_node is not None else layout[0][1]
            self._reserve([(n.node_id, count) for n, count in layout], "STRICT_PACK", nodes, timeout_s)

    def _layout(self, nodes: list[NodeSlots], devices_per_node: int | None) -> list[tuple[NodeSlots, int]]:
        """(node, device count) per pool node, in rank order; raises RuntimeError if it cannot fit."""
        layout: list[tuple[NodeSlots, int]] = []
        left = self.num_devices
        if devices_per_node is None:
            for node in nodes:
                if left == 0:
                    break
                take = min(node.capacity, left)
                if take > 0:
                    layout.append((node, take))
                    left -= take
        else:
            free = iter(nodes)
            while left > 0:
                want = min(devices_per_node, left)
                node = next((n for n in free if n.capacity >= want), None)
                if node is None:
                    break
                layout.append((node, want))
                left -= want
        if left > 0:
            raise RuntimeError(self._describe("the alive Ray nodes cannot hold this layout", nodes))
        return layout

    def _reserve(
        self, layout: list[tuple[str | None, int]], strategy: str, nodes: list[NodeSlots], timeout_s: float
    ) -> None:
        offset = 0
        for node_id, count in layout:
            kwargs: dict[str, Any] = {"strategy": strategy}
            if node_id is not None:
                kwargs["bundle_label_selector"] = [{NODE_ID_LABEL_KEY: node_id} for _ in range(count)]
            self._pgs.append(placement_group([dict(self.bundle) for _ in range(count)], **kwargs))
            self._offsets.append(offset)
            offset += count
        ready, _ = ray.wait([pg.ready() for pg in self._pgs], num_returns=len(self._pgs), timeout=timeout_s)
        if len(ready) < len(self._pgs):
            self.shutdown()
            raise RuntimeError(self._describe(f"Ray did not grant it within {timeout_s:g}s", nodes))

    def _describe(self, problem: str, nodes: list[NodeSlots]) -> str:
        kind = "GPU" if self.is_gpu else "CPU-slot"
        layout = "one placement group per node, STRICT_PACK" if self.multi_node else "strategy PACK"
        per_node = ", ".join(f"{n.ip}/{n.node_id[:8]}: {n.capacity} ({_fmt(n.resources)})" for n in nodes)
        return (
            f"DevicePool could not reserve {self.num_devices} {kind} devices (num_devices={self.num_devices}, "
            f"devices_per_node={self._requested_per_node}, bundle {self.bundle}, {layout}): {problem}. "
            f"Devices each alive node can hold, by (IP, id): [{per_node or 'no alive nodes'}]. "
            f"Ray has {_fmt(ray.cluster_resources())} in total and {_fmt(ray.available_resources())} available. "
            f"Lower num_devices (or cpus_per_device, or devices_per_node), or start Ray with more resources."
        )

    @property
    def placement_groups(self) -> list[PlacementGroup]:
        """The underlying Ray placement groups, one per pool node in rank order (raises once shut down)."""
        if not self._pgs:
            raise RuntimeError("DevicePool has been shut down")
        return list(self._pgs)

    @property
    def placement_group(self) -> PlacementGroup:
        """The single underlying placement group (single-node layout only; else use `placement_groups`)."""
        pgs = self.placement_groups
        if len(pgs) != 1:
            raise RuntimeError(
                f"DevicePool spans {len(pgs)} placement groups (one per node): use placement_groups "
                "or scheduling_strategy(bundle_index)"
            )
        return pgs[0]

    def _locate(self, bundle_index: int) -> tuple[PlacementGroup, int]:
        """(placement group, index inside it) of global bundle `bundle_index`."""
        if not 0 <= bundle_index < self.num_devices:
            raise IndexError(f"bundle_index {bundle_index} outside [0, {self.num_devices})")
        pgs = self.placement_groups
        for pg, offset in zip(reversed(pgs), reversed(self._offsets), strict=True):
            if bundle_index >= offset:
                return pg, bundle_index - offset
        raise AssertionError("unreachable: offsets start at 0")

    def scheduling_strategy(self, bundle_index: int) -> PlacementGroupSchedulingStrategy:
        """Ray scheduling strategy that pins a task/actor to device `bundle_index` (global index)."""
        pg, local = self._locate(bundle_index)
        return PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=local)

    def bundle_node_ids(self) -> list[str]:
        """Ray node id hosting each bundle, indexed by global bundle index ("" if not placed)."""
        ids: list[str] = []
        for pg in self.placement_groups:
            by_index = placement_group_table(pg).get("bundles_to_node_id", {})
            ids.extend(str(by_index.get(i, "")) for i in range(pg.bundle_count))
        return ids

    @property
    def node_device_counts(self) -> tuple[int, ...]:
        """Bundles per node, nodes in order of first appearance along the bundle indices."""
        counts: dict[str, int] = {}
        for node_id in self.bundle_node_ids():
            counts[node_id] = counts.get(node_id, 0) + 1
        return tuple(counts.values())

    @property
    def num_nodes(self) -> int:
        """Number of distinct Ray nodes hosting the pool's bundles."""
        return len(self.node_device_counts)

    def shutdown(self) -> None:
        """Release every placement group. Idempotent."""
        pgs, self._pgs, self._offsets = self._pgs, [], []
        for pg in pgs:
            remove_placement_group(pg)

    def __enter__(self) -> DevicePool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        kind = "gpu" if self.is_gpu else "cpu"
        layout = f", devices_per_node={self.devices_per_node}" if self.multi_node else ""
        return (
            f"DevicePool(num_devices={self.num_devices}, {kind}, "
            f"cpus_per_device={self.cpus_per_device:g}{layout})"
        )


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


def _ip_key(ip: str) -> tuple[int, int, str]:
    """Sort key of an IP: numeric for valid addresses (IPv4 before IPv6), textual otherwise."""
    try:
        addr = ipaddress.ip_address(ip)
    except ValueError:
        return (9, 0, ip)
    return (addr.version, int(addr), "")
