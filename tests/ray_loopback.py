"""Ray tests run on loopback only (fixture imported by tests/conftest.py for the whole session).

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

from collections.abc import Iterator

import pytest
import ray._private.ray_constants as ray_constants

LOOPBACK_ENV = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


@pytest.fixture(scope="session", autouse=True)
def _ray_on_loopback() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(LOOPBACK_ENV, "0")
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        yield
