"""Short runs on fresh worker actors vs on warm hosts (`unirl.distributed.group.hosts`), side by side.

A driver that starts many short runs one after another (the test session, a sweep of tiny
recipes) pays each run's worker start-up: a new process per rank that imports torch,
transformers and diffusers before it builds anything. Inside `reuse_processes()` the ranks are
built in processes an earlier run handed back. This benchmark connects to one local Ray instance
and alternates runs of one recipe, on the run's own actors (no pool, as any single run) then
on one pool's warm hosts (the pool's first run, which starts its hosts, is a warm-up and not
counted), and reports for each side the median
wall time of a run and of its worker start-up (`remote(...)`), and their ratios warm / fresh. It
also checks that both sides wrote the same rows (apart from measurements of the machine).

    python benchmarks/warm_workers.py [--runs 3] [key=value ...]

Writes JSON lines (stdout and `--out`): one per run, one summary.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import ray  # noqa: E402

import unirl.trainer.engines as engines_module  # noqa: E402
import unirl.trainer.trainer as trainer_module  # noqa: E402
from tests.conftest import untimed  # noqa: E402
from tests.recipes import recipe  # noqa: E402
from unirl.distributed.group.cluster import WORKER_NICENESS  # noqa: E402
from unirl.distributed.group.hosts import HostPool, reuse_processes  # noqa: E402
from unirl.distributed.group.remote import remote as plain_remote  # noqa: E402

# run at the tests' 16 px shrunk set (what the test session runs), on 2 workers, 2 steps
RECIPE = "diffusion/tiny_sd3_flowgrpo"


def timed_remote():
    """`remote` that adds each call's wall time to `timed_remote.seconds`."""

    def remote(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return plain_remote(*args, **kwargs)
        finally:
            remote.seconds += time.perf_counter() - t0

    remote.seconds = 0.0
    return remote


def one_run(overrides: list[str]) -> dict:
    """Run the recipe once in a fresh output directory: wall time, start-up time, its rows."""
    remote = timed_remote()
    trainer_module.remote = engines_module.remote = remote
    with tempfile.TemporaryDirectory() as out:
        cfg = recipe(RECIPE, out, "num_steps=2", "num_devices=2", *overrides)
        t0 = time.perf_counter()
        rows = trainer_module.Trainer(cfg).run()
        wall = time.perf_counter() - t0
    return {"wall_s": wall, "startup_s": remote.seconds, "rows": [untimed(r) for r in rows]}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=3, help="measured runs per side")
    parser.add_argument("--out", default=None)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    ray.init(
        address="local",
        include_dashboard=False,
        log_to_driver=False,
        _system_config={"worker_niceness": WORKER_NICENESS},
    )
    lines = []

    def emit(line: dict) -> None:
        lines.append(line)
        print(json.dumps(line), flush=True)

    sides: dict[str, list[dict]] = {"fresh": [], "warm": []}
    pool = HostPool()
    with reuse_processes(pool):
        one_run(args.overrides)  # starts the warm hosts: not counted
    for i in range(args.runs):
        for side in ("fresh", "warm"):
            if side == "fresh":  # no pool: the run's own actors, as any single run
                run = one_run(args.overrides)
            else:
                with reuse_processes(pool):
                    run = one_run(args.overrides)
            sides[side].append(run)
            emit({"side": side, "run": i, "wall_s": run["wall_s"], "startup_s": run["startup_s"]})
    pool.close()
    ray.shutdown()
    fresh, warm = sides["fresh"], sides["warm"]
    median = {
        s: {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "startup_s")}
        for s, runs in sides.items()
    }
    emit(
        {
            "summary": True,
            "recipe": RECIPE,
            "runs_per_side": args.runs,
            "fresh": median["fresh"],
            "warm": median["warm"],
            "wall_ratio_warm_over_fresh": median["warm"]["wall_s"] / median["fresh"]["wall_s"],
            "startup_ratio_warm_over_fresh": median["warm"]["startup_s"] / median["fresh"]["startup_s"],
            "same_rows": all(a["rows"] == b["rows"] for a, b in zip(fresh, warm, strict=True)),
        }
    )
    if args.out:
        with open(args.out, "w") as f:
            f.writelines(json.dumps(line) + "\n" for line in lines)


if __name__ == "__main__":
    main()
