"""Run training commands as subprocesses, a few at a time, and read back their metrics.

Used by the benchmarks that compare recipes over seeds (`diffusion_ppo.py`, `arith_algorithms.py`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Hashable, Iterator
from dataclasses import dataclass

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Job:
    """One training run: `key` names it to the caller, `cmd` is its argv, `out` its output_dir
    (the run's `metrics.jsonl` is read from there; its stdout and stderr go to `out + ".log"`)."""

    key: Hashable
    cmd: list[str]
    out: str


def in_process_command(
    module: str, recipe: str, steps: int, seed: int, threads: int, out: str, *overrides: str
) -> list[str]:
    """argv of one recipe run through its entry point `module` (`unirl.train_diffusion`,
    `unirl.train_vlm`): one in-process worker, inband data plane, `threads` torch threads, no
    progress bar or sample images, then `overrides`."""
    return [
        sys.executable,
        "-m",
        module,
        f"--config-name={recipe}",
        "++launcher=in_process",  # ++: the shapes recipes have no launcher key
        "transport=inband",
        "num_devices=1",
        f"threads_per_worker={threads}",
        f"num_steps={steps}",
        f"seed={seed}",
        f"output_dir={out}",
        "logging.progress=false",
        "logging.save_images_every=0",
        *overrides,
    ]


def read_metrics(out: str) -> list[dict]:
    """The rows of `<out>/metrics.jsonl`, in order."""
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def run_jobs(jobs: list[Job], parallel: int, env: dict[str, str]) -> Iterator[tuple[Job, list[dict], float]]:
    """Run `jobs` from the repository root, at most `parallel` at once, starting them in order and
    refilling a slot as soon as any run ends. Yields `(job, metrics rows, wall seconds)` as each
    run ends; exits with the tail of its log if one fails."""
    pending, running = list(jobs), []
    while pending or running:
        while pending and len(running) < parallel:
            job = pending.pop(0)
            os.makedirs(os.path.dirname(job.out) or ".", exist_ok=True)
            log = open(job.out + ".log", "w")  # noqa: SIM115  (closed when the run ends)
            proc = subprocess.Popen(job.cmd, cwd=ROOT, env=env, stdout=log, stderr=log)
            running.append((job, log, proc, time.monotonic()))
        done = next((r for r in running if r[2].poll() is not None), None)
        if done is None:
            time.sleep(1.0)
            continue
        running.remove(done)
        job, log, proc, start = done
        wall = time.monotonic() - start
        log.close()
        if proc.returncode != 0:
            sys.exit(f"{job.key} failed (exit {proc.returncode}):\n" + open(job.out + ".log").read()[-3000:])
        yield job, read_metrics(job.out), wall
