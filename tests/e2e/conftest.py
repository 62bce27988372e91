"""End-to-end recipe runs in `ray`-marked modules join the session's shared Ray instance (see
tests/ray_loopback.py); a `ray`-marked test in another module asks for `ray_cluster` itself.

The launcher tests start Ray through the launch scripts (`ray start`), not through a
recipe's driver, so they keep to themselves."""

from __future__ import annotations

import pytest

OWN_RAY = {"test_launchers"}


@pytest.fixture(scope="module", autouse=True)
def _e2e_on_shared_ray(request: pytest.FixtureRequest) -> None:
    marked = request.node.get_closest_marker("ray") is not None
    if marked and request.module.__name__.rsplit(".", 1)[-1] not in OWN_RAY:
        request.getfixturevalue("ray_cluster")
