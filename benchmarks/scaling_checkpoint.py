"""1 vs 2 workers on the tiny recipe, and checkpoint save / load cost, side by side in one run.

    python benchmarks/scaling_checkpoint.py [--steps 6] [--out benchmarks/results/scaling_checkpoint.jsonl]

For each worker count it runs the tiny recipe through `Trainer` on one
private local Ray instance, with a checkpoint at the last step, then resumes
from that checkpoint for one more step to time the restore. It writes JSON
lines: per worker count the median step time (first step excluded), the peak
RSS of the workers, checkpoint save / restore seconds and size; then a summary
with the scaling ratio (1-worker step time / 2-worker step time; on 2 cores
both ranks share them, so > 1 only means the split did not cost more).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import ray
import torch
from hydra import compose, initialize_config_dir

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from unirl.config.validate import validate_recipe  # noqa: E402
from unirl.trainer.checkpoints import read_driver_state  # noqa: E402
from unirl.trainer.trainer import Trainer  # noqa: E402


def recipe(out: str, *overrides: str):
    with initialize_config_dir(config_dir=os.path.join(REPO, "examples"), version_base=None):
        cfg = compose(
            "diffusion/tiny_sd3_flowgrpo",
            overrides=[f"output_dir={out}", "logging.progress=false", *overrides],
        )
    validate_recipe(cfg)
    return cfg


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def measure(devices: int, steps: int, root: str) -> dict:
    out = os.path.join(root, f"w{devices}")
    common = (f"num_devices={devices}", f"checkpoint.every_n_steps={steps}", "logging.save_images_every=0")
    rows = Trainer(recipe(out, f"num_steps={steps}", *common)).run()
    ckpt = os.path.join(out, "checkpoints", f"step_{steps:06d}")
    resumed = Trainer(recipe(out, f"num_steps={steps + 1}", "resume_from=latest", *common)).run()
    return {
        "bench": "scaling_checkpoint",
        "num_devices": devices,
        "steps": steps,
        "step_s_median": statistics.median(r["time/step_s"] for r in rows[1:]),
        "rollout_s_median": statistics.median(r["time/rollout_s"] for r in rows[1:]),
        "train_s_median": statistics.median(r["time/train_s"] for r in rows[1:]),
        "worker_peak_rss_mb": max(r["memory/worker_peak_rss_mb"] for r in rows),
        "checkpoint_save_s": read_driver_state(ckpt)["save_s"],
        "checkpoint_restore_s": resumed[0]["time/restore_s"],
        "checkpoint_bytes": dir_bytes(ckpt),
        "checkpoint_train_state_bytes": dir_bytes(os.path.join(ckpt, "train")),
        "reward_mean_last": rows[-1]["reward/mean"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument(
        "--out", default=os.path.join(REPO, "benchmarks", "results", "scaling_checkpoint.jsonl")
    )
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ray.init(
        address="local",
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        _node_ip_address="127.0.0.1",
    )
    lines = []
    try:
        with tempfile.TemporaryDirectory() as root:
            results = {d: measure(d, args.steps, root) for d in (1, 2)}
    finally:
        ray.shutdown()
    lines.extend(results.values())
    lines.append(
        {
            "bench": "scaling_checkpoint",
            "summary": True,
            "scaling_ratio_1_over_2": results[1]["step_s_median"] / results[2]["step_s_median"],
            "torch": torch.__version__,
            "cpu_count": os.cpu_count(),
            "note": "2 workers share the machine's cores; the ratio shows the cost of sharding, not GPU scaling",
        }
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "a") as f:
        for line in lines:
            print(json.dumps(line))
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
