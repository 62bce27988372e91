"""End-to-end recipe runs join the session's shared Ray instance (see tests/ray_loopback.py).

The launcher tests start Ray through the launch scripts (`ray start`), not through a
recipe's driver, so they keep to themselves."""

from __future__ import annotations

import pytest

OWN_RAY = {"test_launchers"}


@pytest.fixture(scope="module", autouse=True)
def _e2e_on_shared_ray(request: pytest.FixtureRequest) -> None:
    if request.module.__name__.rsplit(".", 1)[-1] not in OWN_RAY:
        request.getfixturevalue("ray_cluster")
