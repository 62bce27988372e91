"""Step time of the sequential vs the overlapped loop (bounded staleness) on 2 workers.

The tiny recipe `examples/diffusion/tiny_sd3_dedicated_separate.yaml` as shipped (32 samples of
32x32, 10 sampling steps, 4 of them SDE; LoRA Flow-GRPO), where sampling a rollout and training
on it take about as long, on two workers: one train worker and one dedicated rollout engine on a
device of its own (placement separate), one torch thread each. Side by side, in one run:

- `sequential`: `rollout.max_staleness=0`: every step rolls out, then trains (each worker
  waits while the other computes);
- `overlapped`: `rollout.max_staleness=1`: step n+1's rollout runs on the engine, with the
  weights one version behind, while step n trains;
- `stale_2`: `rollout.max_staleness=2`: steps n+1 and n+2 are sampled on weights n while steps
  n and n+1 train (a sync every second step);
- `trainside` (context): the same model work sampled by the train worker itself, one worker with
  one thread (`diffusion/tiny_sd3_flowgrpo`): no second process, nothing to sync.

Each configuration runs `--steps` steps through `Trainer` (on one private local Ray instance), in
`--repeats` interleaved rounds; the figure is the median `time/step_s` over the steps after the
first two (warm-up) of every round, and the ratio overlapped / sequential (goal <= 0.75).

Output: JSON lines on stdout and appended to `--out`.

    python benchmarks/overlap.py [--steps 12] [--repeats 2] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.pop("RAY_ADDRESS", None)  # a private Ray instance, never another user's cluster
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # everything binds to loopback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import ray  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402

from unirl.config.validate import validate_recipe  # noqa: E402
from unirl.trainer.trainer import Trainer  # noqa: E402

SEPARATE = "diffusion/tiny_sd3_dedicated_separate"
CONFIGS = {
    "sequential": (SEPARATE, ["rollout.max_staleness=0"]),
    "overlapped": (SEPARATE, ["rollout.max_staleness=1"]),
    "stale_2": (SEPARATE, ["rollout.max_staleness=2"]),
    "trainside": ("diffusion/tiny_sd3_flowgrpo", ["threads_per_worker=1"]),
}
WARMUP = 2


def run(name: str, steps: int) -> list[dict]:
    recipe, overrides = CONFIGS[name]
    with tempfile.TemporaryDirectory() as out:
        with initialize_config_dir(config_dir=os.path.join(REPO, "examples"), version_base=None):
            cfg = compose(
                recipe,
                overrides=[
                    *overrides,
                    f"num_steps={steps}",
                    f"output_dir={out}",
                    "logging.progress=false",
                    "logging.save_images_every=0",
                ],
            )
        validate_recipe(cfg)
        return Trainer(cfg).run()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "overlap.jsonl"))
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    timed: dict[str, list[dict]] = {name: [] for name in CONFIGS}
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        for _ in range(args.repeats):
            for name in CONFIGS:
                timed[name] += run(name, args.steps)[WARMUP:]
    finally:
        ray.shutdown()
    lines = []
    for name, rows in timed.items():

        def median(key: str, rows=rows) -> float:
            return statistics.median(r[key] for r in rows if key in r)

        lines.append(
            {
                "bench": "overlap",
                "config": name,
                "steps_timed": len(rows),
                "step_s": median("time/step_s"),
                "rollout_wait_s": median("time/rollout_s"),
                "train_s": median("time/train_s"),
                "sync_s": median("time/sync_s") if any("time/sync_s" in r for r in rows) else None,
                "staleness": median("rollout/staleness")
                if any("rollout/staleness" in r for r in rows)
                else None,
            }
        )
    by = {line["config"]: line for line in lines}
    lines.append(
        {
            "bench": "overlap",
            "summary": "overlapped / sequential step time (goal <= 0.75)",
            "ratio": by["overlapped"]["step_s"] / by["sequential"]["step_s"],
            "stale_2_over_sequential": by["stale_2"]["step_s"] / by["sequential"]["step_s"],
            "trainside_over_sequential": by["trainside"]["step_s"] / by["sequential"]["step_s"],
        }
    )
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "a") as f:
        for line in lines:
            print(json.dumps(line))
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
