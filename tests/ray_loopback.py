"""Ray tests run on loopback only, on one shared local cluster (fixtures imported by tests/conftest.py).

Ray rewrites 127.0.0.1 addresses (e.g. ``ray.init(address="127.0.0.1:port")``
and the address a `ray.cluster_utils.Cluster` node advertises) to the
machine's outward IP unless ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``. The
session-scoped fixture below sets that variable (inherited by every Ray
process the tests start) and the constant Ray read from it at import time, and
restores both afterwards. Each test module still starts and shuts down its own
Ray instance in module-scoped fixtures; pytest tears one module's fixtures
down before the next module's are set up, so they never overlap.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import ray
import ray._private.ray_constants as ray_constants

from unirl.distributed.group.cluster import WORKER_NICENESS
from unirl.distributed.group.hosts import reuse_processes

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@pytest.fixture(scope="session", autouse=True)
def _ray_on_loopback() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LOOPBACK_ENV, "0")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        yield


SHARED_NUM_CPUS = 8  # logical CPUs: room for the largest test geometry (workers + separate engines)
_shared: dict[str, str] = {}
# the shared instance's warm worker processes (unirl.distributed.group.hosts): a run's train
# workers and engines are built in processes that earlier runs of this session imported torch in
_warm = contextlib.ExitStack()


def shared_ray_address() -> str | None:
    """The GCS address of the shared instance when this process is connected to it, else None."""
    if ray.is_initialized() and _shared.get("address"):
        return _shared["address"]
    return None


def ensure_shared_ray() -> str:
    """Connect this process to the shared local instance, starting it if needed; its address."""
    if not ray.is_initialized():
        info = ray.init(
            address="local",
            num_cpus=SHARED_NUM_CPUS,
            include_dashboard=False,
            log_to_driver=False,
            _node_ip_address="127.0.0.1",
            _system_config={"worker_niceness": WORKER_NICENESS},  # as a run's own instance (init_ray)
        )
        _shared["address"] = info.address_info["gcs_address"]
        _warm.close()
        _warm.enter_context(reuse_processes())
    return _shared["address"]


def release_shared_ray() -> None:
    """Stop the shared instance (before a test builds a cluster of its own)."""
    _warm.close()
    if ray.is_initialized():
        ray.shutdown()
    _shared.clear()


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[str]:
    """The shared local Ray instance for a module (started on first use, kept for the next
    module); yields its address."""
    yield ensure_shared_ray()


@pytest.fixture(scope="session", autouse=True)
def _shared_ray_ends_with_the_session() -> Iterator[None]:
    yield
    release_shared_ray()
