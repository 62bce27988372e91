"""The 2-worker tiny recipe across two Ray nodes simulated on one machine (loopback only)."""

from __future__ import annotations

import json
import os

import pytest
import ray
from ray.cluster_utils import Cluster

from tests.ray_loopback import release_shared_ray
from tests.recipes import recipe
from unirl.trainer.trainer import Trainer

pytestmark = pytest.mark.ray


@pytest.fixture(scope="module")
def two_nodes():
    release_shared_ray()  # this module needs a cluster of its own
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    ray.shutdown()
    cluster.shutdown()


def test_two_worker_recipe_spans_two_nodes(two_nodes, tmp_path):
    assert len([n for n in ray.nodes() if n["Alive"]]) == 2
    trainer = Trainer(recipe("diffusion/tiny_sd3_flowgrpo", tmp_path, "num_devices=2", "num_steps=2"))
    rows = trainer.run()
    assert [r["step"] for r in rows] == [1, 2]
    assert all(abs(r["ratio/first_update_mean"] - 1.0) < 1e-4 for r in rows)
    # one device per node: the pool could not fit both on one 1-CPU node
    placed = json.loads(open(os.path.join(tmp_path, "placement.json")).read())
    assert placed["num_nodes"] == 2 and len(set(placed["bundle_node_ids"])) == 2
