"""Shared fixtures: tiny SD3 components built from configs (offline, CPU)."""

from __future__ import annotations

import os
import subprocess

import pytest
import ray
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tests.ray_loopback import (  # noqa: E402,F401  (session-wide loopback and the shared Ray instance)
    _ray_on_loopback,
    _shared_ray_ends_with_the_session,
    ray_cluster,
    shared_ray_address,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# "The replay recomputes the rollout" (a first on-policy ratio of 1, a drift of 0) holds bit for bit
# only where a forward rounds the same whatever its batch size: on CPUs where ATen dispatches AVX2
# kernels. With AVX-512 kernels a batch of another size rounds differently (a first ratio of
# 1 - 1.5e-8, a drift of 7e-7, measured on a 2-core AVX-512 Xeon); a wrong pi_old is off by far more.
KERNEL_ROUNDING = 1e-6
EXAMPLES = os.path.join(REPO, "examples")


def run_module(
    module: str, *args: str, timeout: float = 600, env: dict | None = None
) -> subprocess.CompletedProcess:
    """`python -m <module> <args>` from the repository root, offline, output captured as text, in
    a process forked from the preloaded server of `tests.gloo` (the module runs as `python -m`
    runs it, without importing torch and the model libraries afresh). While this process holds
    the shared Ray instance (`ray_cluster`), a run joins it through ``RAY_ADDRESS`` instead of
    starting its own (unless `env` names another)."""
    from tests.gloo import run_module_forked

    joined = {"RAY_ADDRESS": address} if (address := shared_ray_address()) else {}
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **joined, **(env or {})}
    return run_module_forked(module, list(args), env, REPO, timeout)


def _measured(key: str) -> bool:
    return key.startswith(("time/", "memory/", "cpu/")) or (
        key.startswith(("dataplane/", "sync/")) and key.endswith("_s")
    )


def untimed(row: dict) -> dict:
    """A metrics row without its measurements of the machine (wall-clock times, process memory, the
    CPU threads and the load of other processes: `cpu/...`), a composed track's (`<track>/time/...`)
    included."""
    return {k: v for k, v in row.items() if not (_measured(k) or _measured(k.partition("/")[2]))}


def pytest_collection_modifyitems(config, items):
    """A test on the shared Ray instance carries the `ray` marker (else the run stops here, naming
    it); files with `ray` tests run first; `gpu`-marked tests need CUDA: skipped, with the reason,
    where torch sees no GPU."""
    unmarked = [i.nodeid for i in items if "ray_cluster" in i.fixturenames and "ray" not in i.keywords]
    if unmarked:
        raise pytest.UsageError(f"tests on the shared Ray instance need @pytest.mark.ray: {unmarked}")
    # the files with Ray tests (the long end-to-end runs) first: pytest-xdist hands out files in
    # this order, so the short ones fill in at the end instead of a long one running alone
    ray_files = {i.path for i in items if "ray" in i.keywords}
    items.sort(key=lambda i: i.path not in ray_files)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (the GPU tier: bash scripts/gpu_tier.sh)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def tiny_model_config(**overrides):
    from unirl.models.sd3 import SD3ModelConfig, TinySD3Config

    tiny = dict(resolution=16, patch_size=4, num_layers=1, clip_max_length=8, seed=0)
    tiny.update(overrides)
    return SD3ModelConfig(tiny=TinySD3Config(**tiny))


def _ray_refused(*args, **kwargs):
    raise RuntimeError(
        "this test starts Ray: mark it @pytest.mark.ray (pytest -m 'not ray' runs without Ray)"
    )


@pytest.fixture(autouse=True)
def _ray_only_in_ray_tests(request: pytest.FixtureRequest):
    """Outside `ray`-marked tests `ray.init` raises and Ray reads as not started (even while the
    shared instance is up), so a test that starts or joins Ray in this process without the marker
    fails, naming the marker."""
    if request.node.get_closest_marker("ray") is not None:
        yield
        return
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ray, "init", _ray_refused)
        mp.setattr(ray, "is_initialized", lambda: False)
        yield


@pytest.fixture(scope="session", autouse=True)
def _quiet_and_threads():
    from unirl.trainer.worker import quiet_library_logs

    quiet_library_logs()
    # 2 cores: two threads in one test process, one each under pytest-xdist's 2 workers
    torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else 2)


@pytest.fixture
def tiny_bundle():
    return tiny_model_config().build()
