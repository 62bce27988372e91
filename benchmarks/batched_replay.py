"""Batched-step replay against per-step replay: train-phase time on 1 rank and on 2 FSDP2 ranks.

A trained sample's S SDE steps are replayed either one forward per step
(`stage.replay_steps_per_forward=1`) or all in one forward over a batch of
(latent, sigma) pairs (`=S`). Under FSDP2 with `reshard_after_forward` every
forward all-gathers the parameters again (and every backward reduce-scatters),
so batching the steps saves S - 1 all-gathers per micro-batch besides the
smaller per-forward overheads. This runs a recipe through its entry point
(Ray, FSDP2 over gloo for 2 ranks) both ways, alternating which side runs
first, and reports the median `time/train_s` after `--warmup` steps and the
ratio batched / per-step at each rank count. The two sides train the same
samples (the recipe's seed): `tests/algorithms/test_batched_replay.py` holds
their log-probs and gradients equal.

    python benchmarks/batched_replay.py [--recipe diffusion/tiny_sd3_flowgrpo] [--steps 8]
        [--warmup 2] [--reps 2] [--ranks 1 2] [key=value ...]

Writes JSON lines (stdout and `--out`): one per run, one summary per rank count.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from benchmarks.runs import Job, run_jobs  # noqa: E402

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "batched_replay.jsonl")


def command(
    recipe: str, steps: int, ranks: int, per_forward: int, out: str, overrides: list[str]
) -> list[str]:
    return [
        sys.executable,
        "-m",
        "unirl.train_diffusion",
        f"--config-name={recipe}",
        f"num_steps={steps}",
        f"num_devices={ranks}",
        f"stage.replay_steps_per_forward={per_forward}",
        f"output_dir={out}",
        "logging.progress=false",
        "logging.save_images_every=0",
        *overrides,
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--recipe", default="diffusion/tiny_sd3_flowgrpo")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    ap.add_argument("--reps", type=int, default=2, help="runs of each side per rank count")
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--sde-steps", type=int, default=4, help="sampling.sde_num_steps: the S batched")
    ap.add_argument("--work", default=os.path.join(REPO, "outputs", "bench_batched_replay"))
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    overrides = [f"sampling.sde_num_steps={args.sde_steps}", *args.overrides]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    sides = {"per_step": 1, "batched": args.sde_steps}
    with open(args.out, "w") as f:

        def emit(row: dict) -> None:
            print(json.dumps(row), flush=True)
            f.write(json.dumps(row) + "\n")

        for ranks in args.ranks:
            train: dict[str, list[float]] = {side: [] for side in sides}
            for rep in range(args.reps):
                order = list(sides) if rep % 2 == 0 else list(reversed(sides))
                for side in order:
                    out = os.path.join(args.work, f"r{ranks}_{side}_{rep}")
                    cmd = command(args.recipe, args.steps, ranks, sides[side], out, overrides)
                    for _, rows, wall in run_jobs([Job(side, cmd, out)], 1, env):
                        steps = [r for r in rows if "time/train_s" in r][args.warmup :]
                        times = [r["time/train_s"] for r in steps]
                        train[side] += times
                        emit(
                            {
                                "ranks": ranks,
                                "side": side,
                                "rep": rep,
                                "steps_per_forward": sides[side],
                                "train_s_median": statistics.median(times),
                                "train_s": times,
                                "rewards": [r.get("reward/mean") for r in steps],
                                "wall_s": wall,
                            }
                        )
            per_step, batched = (statistics.median(train[s]) for s in sides)
            emit(
                {
                    "summary": True,
                    "ranks": ranks,
                    "sde_steps": args.sde_steps,
                    "recipe": args.recipe,
                    "per_step_train_s": per_step,
                    "batched_train_s": batched,
                    "ratio": batched / per_step,
                }
            )


if __name__ == "__main__":
    main()
