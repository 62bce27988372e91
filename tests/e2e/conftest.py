"""End-to-end recipe runs in `ray`-marked modules join the session's shared Ray instance (see
tests/ray_loopback.py); a `ray`-marked test in another module asks for `ray_cluster` itself.

The launcher tests start Ray through the launch scripts (`ray start`), not through a
recipe's driver, so they keep to themselves. The README's main job runs once, through the
single-node launcher, in test_tiny_recipe (`run_dir`), which checks the launcher's run and what
the job wrote."""

from __future__ import annotations

import os
import sys

import pytest

OWN_RAY = {"test_launchers"}
LAUNCHER_VARS = ("ROLE", "HEAD_ADDR", "RAY_ADDRESS", "NNODES", "NUM_DEVICES", "NUM_STEPS", "DRY_RUN")


@pytest.fixture(scope="module", autouse=True)
def _e2e_on_shared_ray(request: pytest.FixtureRequest) -> None:
    marked = request.node.get_closest_marker("ray") is not None
    if marked and request.module.__name__.rsplit(".", 1)[-1] not in OWN_RAY:
        request.getfixturevalue("ray_cluster")


def launcher_env(**extra: str) -> dict[str, str]:
    """This process's environment without launcher variables, plus `extra`, offline."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    return {**env, "PYTHON": sys.executable, "HF_HUB_OFFLINE": "1", **extra}
