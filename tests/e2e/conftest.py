"""End-to-end recipe runs in `ray`-marked modules join the session's shared Ray instance (see
tests/ray_loopback.py); a `ray`-marked test in another module asks for `ray_cluster` itself.

The launcher tests start Ray through the launch scripts (`ray start`), not through a
recipe's driver, so they keep to themselves. The README's main job runs once per session,
through the single-node launcher (`readme_main_job`): test_launchers checks the launcher's
run, test_tiny_recipe what the job wrote."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

OWN_RAY = {"test_launchers"}
SINGLE = os.path.join(REPO, "examples", "run_experiment_single_node.sh")
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


@pytest.fixture(scope="session")
def readme_main_job(tmp_path_factory) -> Path:
    """The README's main job as it ships (`diffusion/tiny_sd3_flowgrpo`, 30 steps, about 90 s on
    2 idle cores) through `run_experiment_single_node.sh`, which starts its own Ray: NUM_STEPS=30
    (the recipe's own value) and OUTPUT_DIR from the environment, `logging.progress=false` as an
    argument. Its output directory; the timeout leaves room for a machine shared with other jobs."""
    out = tmp_path_factory.mktemp("tiny_run")
    res = subprocess.run(
        ["bash", SINGLE, "diffusion/tiny_sd3_flowgrpo", "logging.progress=false"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        env=launcher_env(NUM_STEPS="30", OUTPUT_DIR=str(out)),
    )
    assert res.returncode == 0, res.stderr[-4000:]
    return out
