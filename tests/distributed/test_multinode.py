"""DevicePool and worker groups spanning Ray nodes, and `init_ray`.

The "nodes" are simulated: a `ray.cluster_utils.Cluster` with a head and one
extra raylet (1 CPU each) on this machine, all on 127.0.0.1. One cluster for
the module, and for the 2-worker tiny recipe run across its two nodes (the first test after
the cluster's own, before any pool holds a share of a node).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from tests.ray_loopback import release_shared_ray
from tests.recipes import recipe
from unirl.distributed.group import DevicePool, Worker, WorkerGroup, init_ray, placement, remote
from unirl.distributed.group import cluster as cluster_mod
from unirl.trainer.trainer import Trainer

pytestmark = pytest.mark.ray

# Ray workers cannot import this test module by name: ship its classes by value.
ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class WhereWorker(Worker):
    def where(self) -> tuple[str, dict[str, str]]:
        keys = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
        return ray.get_runtime_context().get_node_id(), {k: os.environ[k] for k in keys}

    def all_reduce(self) -> list[float]:
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
        t = torch.tensor([1.0, 2.0]) * (self.rank_info.rank + 1)
        dist.all_reduce(t)
        return t.tolist()

    def teardown(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def alive_node_ids_by_ip() -> list[str]:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    return [n["NodeID"] for n in sorted(nodes, key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))]


@pytest.fixture(scope="module")
def cluster(request: pytest.FixtureRequest) -> Cluster:
    release_shared_ray()  # this module needs a cluster of its own
    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})

    def finish() -> None:
        ray.shutdown()
        c.shutdown()

    request.addfinalizer(finish)
    c.add_node(num_cpus=1)
    c.wait_for_nodes()
    ray.init(address=c.address, log_to_driver=False)
    return c


@pytest.fixture(scope="module")
def spread_pool(cluster: Cluster) -> Iterator[DevicePool]:
    # 0.25 CPU per device: leaves 0.75 CPU per node for the other pools below.
    pool = DevicePool(2, cpus_per_device=0.25, use_gpu=False, devices_per_node=1, timeout_s=30)
    yield pool
    pool.shutdown()


@pytest.fixture(scope="module")
def spread_group(spread_pool: DevicePool) -> Iterator[WorkerGroup]:
    group = remote(WhereWorker, placement(spread_pool), env={"GLOO_SOCKET_IFNAME": "lo"})
    yield group
    group.shutdown()


def test_cluster_is_two_loopback_nodes(cluster: Cluster) -> None:
    nodes = [n for n in ray.nodes() if n["Alive"]]
    assert len(nodes) == 2
    assert {n["NodeManagerAddress"] for n in nodes} == {"127.0.0.1"}


def test_two_worker_recipe_spans_two_nodes(cluster: Cluster, tmp_path) -> None:
    """The tiny recipe on 2 workers: one device per 1-CPU node, trained across them (gloo FSDP2)."""
    trainer = Trainer(recipe("diffusion/tiny_sd3_flowgrpo", tmp_path, "num_devices=2", "num_steps=2"))
    rows = trainer.run()
    assert [r["step"] for r in rows] == [1, 2]
    assert all(abs(r["ratio/first_update_mean"] - 1.0) < 1e-4 for r in rows)
    placed = json.loads((tmp_path / "placement.json").read_text())
    assert placed["num_nodes"] == 2 and len(set(placed["bundle_node_ids"])) == 2


def test_pool_puts_one_rank_per_node_in_node_order(
    spread_pool: DevicePool, spread_group: WorkerGroup
) -> None:
    expected = alive_node_ids_by_ip()
    assert (spread_pool.num_nodes, spread_pool.devices_per_node, spread_pool.multi_node) == (2, 1, True)
    assert len(spread_pool.placement_groups) == 2
    assert spread_pool.bundle_node_ids() == expected
    assert spread_pool.node_device_counts == (1, 1)
    with pytest.raises(RuntimeError, match="spans 2 placement groups"):
        _ = spread_pool.placement_group

    where = spread_group.where()
    node_ids = [node for node, _ in where]
    assert node_ids == expected and node_ids[0] != node_ids[1]
    infos = spread_group.rank_infos
    assert [(i.rank, i.node_rank, i.local_rank) for i in infos] == [(0, 0, 0), (1, 1, 0)]
    # Rank 0's node IP (every simulated node is 127.0.0.1) and a port probed there.
    assert {i.master_addr for i in infos} == {"127.0.0.1"}
    port = infos[0].master_port
    assert port > 0 and {i.master_port for i in infos} == {port}
    for r, (_, env) in enumerate(where):
        assert env == {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(r),
            "WORLD_SIZE": "2",
            "LOCAL_RANK": "0",
        }


def test_gloo_all_reduce_across_nodes(spread_group: WorkerGroup) -> None:
    try:
        out = spread_group.all_reduce()
    finally:
        spread_group.teardown()
    assert out == [[3.0, 6.0], [3.0, 6.0]]


def test_inferred_layout_fills_nodes_in_order(spread_pool: DevicePool) -> None:
    # 0.75 CPU per device: each 1-CPU node holds one, so 2 devices need both nodes.
    with DevicePool(2, cpus_per_device=0.75, use_gpu=False, timeout_s=30) as pool:
        assert pool.multi_node and pool.devices_per_node == 1
        assert pool.bundle_node_ids() == alive_node_ids_by_ip()
        assert pool.num_nodes == 2
        assert pool.scheduling_strategy(1).placement_group_bundle_index == 0
        with pytest.raises(IndexError):
            pool.scheduling_strategy(2)
    with pytest.raises(RuntimeError, match="shut down"):
        pool.bundle_node_ids()


def test_single_node_layout_is_kept_when_devices_fit(spread_pool: DevicePool) -> None:
    with DevicePool(2, cpus_per_device=0.25, use_gpu=False, timeout_s=30) as pool:
        assert not pool.multi_node and pool.num_nodes == 1
        assert len(pool.placement_groups) == 1 and pool.placement_group is pool.placement_groups[0]
        assert pool.node_device_counts == (2,)


def test_layout_errors_name_the_request_and_the_cluster(cluster: Cluster) -> None:
    with pytest.raises(RuntimeError, match=r"num_devices=4, devices_per_node=3.*cannot hold") as exc:
        DevicePool(4, use_gpu=False, devices_per_node=3, timeout_s=30)
    assert "127.0.0.1/" in str(exc.value) and "CPU: 2" in str(exc.value)
    with pytest.raises(
        RuntimeError, match=r"reserve 5 CPU-slot devices.*devices_per_node=None.*Lower num_devices"
    ):
        DevicePool(5, use_gpu=False, timeout_s=30)
    with pytest.raises(ValueError, match="devices_per_node"):
        DevicePool(2, use_gpu=False, devices_per_node=0)


def test_init_ray_does_nothing_when_initialized(cluster: Cluster) -> None:
    assert ray.is_initialized()
    assert init_ray(num_cpus=1) is False
    assert len(alive_node_ids_by_ip()) == 2


def test_init_ray_joins_ray_address(cluster: Cluster) -> None:
    # A fresh process (this one stays connected): with RAY_ADDRESS set, init_ray
    # joins the 2-node cluster instead of starting a 1-node instance.
    code = (
        "import json, ray\n"
        "from unirl.distributed.group.cluster import init_ray\n"
        "started = init_ray(num_cpus=1)\n"
        "nodes = [n for n in ray.nodes() if n['Alive']]\n"
        "print(json.dumps({'started': started, 'nodes': len(nodes), 'cpus': ray.cluster_resources().get('CPU')}))\n"
        "ray.shutdown()\n"
    )
    env = dict(os.environ, RAY_ADDRESS=cluster.address, PYTHONPATH=REPO)
    res = subprocess.run(
        [sys.executable, "-c", code], env=env, cwd=REPO, capture_output=True, text=True, timeout=90
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(res.stdout.strip().splitlines()[-1]) == {"started": False, "nodes": 2, "cpus": 2.0}
    assert len(alive_node_ids_by_ip()) == 2  # the cluster outlives the joined driver


def test_init_ray_call_contract(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[dict[str, Any]] = []
    monkeypatch.setattr(cluster_mod.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(cluster_mod.ray, "init", lambda **kw: calls.append(kw))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert init_ray(num_cpus=3) is True
    assert calls[-1] == {
        "address": "local",
        "num_cpus": 3,
        "include_dashboard": False,
        "log_to_driver": True,
        "_node_ip_address": "127.0.0.1",
        "_system_config": {"worker_niceness": 0},
    }
    monkeypatch.setenv("RAY_ADDRESS", "local")  # a new local instance too, owned by the caller
    assert init_ray(num_cpus=3) is True and calls[-1]["address"] == "local" and len(calls) == 2
    monkeypatch.setenv("RAY_ADDRESS", "10.1.2.3:6379")
    assert init_ray(num_cpus=3) is False
    assert calls[-1] == {"address": "10.1.2.3:6379", "log_to_driver": True}
