"""The multi-node launcher in examples/ runs the shrunken tiny recipe for real (the single-node
launcher runs the README's main job in test_tiny_recipe.py).

Several nodes:
`run_experiment_multinode.sh` as the head of a one-node cluster on loopback, with its own GCS
port, client-server port and temp dir, in its own session (`setsid`); the test stops exactly
the processes left in that session, never with `ray stop`, which would kill every Ray
instance on the machine.

The worker role is not run: `ray start --address=...` (Ray 2.60) refuses to join when Ray is
held to loopback (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, tests/ray_loopback.py), and without that
it rewrites 127.0.0.1 to the machine's outward IP, where a loopback head does not listen. The
placement across nodes is tested with simulated nodes in tests/distributed/test_multinode.py.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.e2e.conftest import launcher_env
from tests.recipes import SD3, rows

pytestmark = [pytest.mark.e2e, pytest.mark.ray]

MULTI = os.path.join(REPO, "examples", "run_experiment_multinode.sh")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def session_pids(sid: int) -> list[int]:
    """Pids of the live processes in session `sid` (from /proc/<pid>/stat)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()  # state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def stop_session(sid: int, grace_s: float = 10.0) -> None:
    """SIGTERM every process of session `sid`, then SIGKILL what is left after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in session_pids(sid):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace_s
        while session_pids(sid) and time.monotonic() < deadline:
            time.sleep(0.2)
        if not session_pids(sid):
            return


def metrics_steps(out: Path) -> list[int]:
    return [r["step"] for r in rows(out)]


def assert_final_checkpoint(out: Path, optimizer_steps: int) -> None:
    final = out / "checkpoints" / "final"
    assert (final / "pytorch_lora_weights.safetensors").stat().st_size > 0
    meta = json.loads((final / "unirl_checkpoint.json").read_text())
    assert meta["kind"] == "lora" and meta["optimizer_steps"] == optimizer_steps


def test_multinode_launcher_head_runs_the_recipe(tmp_path: Path) -> None:
    out = tmp_path / "run"
    # Ray's socket paths must stay short: not under pytest's deep tmp_path.
    ray_tmp = tempfile.mkdtemp(prefix="unirl-launch-", dir="/tmp")
    env = launcher_env(
        ROLE="head",
        NNODES="1",
        HEAD_ADDR="127.0.0.1",
        RAY_PORT=str(free_port()),
        RAY_TMPDIR=ray_tmp,
        RAY_START_ARGS=f"--include-dashboard=false --ray-client-server-port={free_port()}",
        NUM_STEPS="2",
        OUTPUT_DIR=str(out),
    )
    log = tmp_path / "head.log"
    with open(log, "w") as f:
        head = subprocess.Popen(
            ["bash", MULTI, "diffusion/tiny_sd3_flowgrpo", *SD3],
            cwd=REPO,
            stdout=f,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
    try:
        rc = head.wait(timeout=300)
        assert rc == 0, log.read_text()[-4000:]
        assert "1 Ray node(s) alive" in log.read_text()
        # the launcher leaves its Ray node running after the driver: the processes of its session
        assert session_pids(head.pid), "the head's Ray node should outlive the driver"
    finally:
        stop_session(head.pid)  # start_new_session: the session id is the launcher's pid
        if head.poll() is None:
            head.kill()
            head.wait(timeout=30)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert not session_pids(head.pid)
    assert metrics_steps(out) == [1, 2]
    assert_final_checkpoint(out, optimizer_steps=2)


@pytest.mark.parametrize(
    ("env", "args", "message"),
    [
        ({}, ["diffusion/tiny_sd3_flowgrpo"], "set ROLE=head"),
        ({"ROLE": "driver"}, ["diffusion/tiny_sd3_flowgrpo"], "got ROLE='driver'"),
        ({"ROLE": "worker"}, [], "ROLE=worker needs HEAD_ADDR"),
        ({"ROLE": "head"}, [], "usage: ROLE=head"),
    ],
)
def test_multinode_launcher_rejects_bad_roles(env: dict[str, str], args: list[str], message: str) -> None:
    res = subprocess.run(
        ["bash", MULTI, *args], cwd=REPO, capture_output=True, text=True, timeout=30, env=launcher_env(**env)
    )
    assert res.returncode == 2 and message in res.stderr, res.stderr
