"""Flow-PPO (a per-step critic, GAE over the SDE steps) against Flow-GRPO on one sample budget.

Worlds:
  tiny: tiny redness (diffusion/tiny_ppo vs diffusion/tiny_sd3_flowgrpo: 4 prompts x 8 images
        a step), plus a random-reward control of Flow-PPO (`RandomReward` trains, redness is
        logged at weight 0, so a rise there is not learning from the reward).
  shapes: the shapes world (diffusion/shapes_ppo vs diffusion/shapes_flowgrpo: 8 prompts x 8
        images a step), several seeds, the recipes' held-out strict evaluation (51 prompts x 4
        fixed seeds) at step 0 and at the last step.

Each run is its recipe through the real entry point (`python -m unirl.train_diffusion`,
in-process, inband data plane, `--threads` torch threads); `--parallel` runs at once (their
clocks then share the cores: compare per step, not per second).

    python benchmarks/diffusion_ppo.py --world tiny [--steps 30] [--seeds 0] [--parallel 3]
    python benchmarks/diffusion_ppo.py --world shapes [--steps 20] [--seeds 0,1,2] [--parallel 2]
        [--eval-samples 4]
        [--only ppo,flowgrpo,...] [--out benchmarks/figures/diffusion_ppo.jsonl]

Writes one JSON line per run (`world, run, seed, steps, clock_s, reward_first, reward_last`, and
for shapes `eval_first` / `eval_last`: the `eval/...` values at step 0 and at the end) and prints
the mean and population std over seeds per run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runs import ROOT, Job, in_process_command, run_jobs  # noqa: E402
from tiny_forward_process import RANDOM_REWARD  # noqa: E402  (the redness world's control)

WORLDS: dict[str, dict[str, tuple[str, list[str]]]] = {
    "tiny": {
        "flowgrpo": ("diffusion/tiny_sd3_flowgrpo", []),
        "ppo": ("diffusion/tiny_ppo", []),
        "control_random_ppo": ("diffusion/tiny_ppo", RANDOM_REWARD),
        "control_random_flowgrpo": ("diffusion/tiny_sd3_flowgrpo", RANDOM_REWARD),
    },
    "shapes": {
        "flowgrpo": ("diffusion/shapes_flowgrpo", []),
        "ppo": ("diffusion/shapes_ppo", []),
    },
}
DEFAULT_RUNS = {"tiny": "flowgrpo,ppo,control_random_ppo", "shapes": "flowgrpo,ppo"}
REWARD = {"tiny": "reward/redness/mean", "shapes": "reward/geneval/mean"}


def command(
    world: str,
    recipe: str,
    overrides: list[str],
    steps: int,
    seed: int,
    threads: int,
    out: str,
    eval_samples: int,
):
    cmd = in_process_command("unirl.train_diffusion", recipe, steps, seed, threads, out, *overrides)
    if world == "shapes":
        cmd += [f"eval.every_n_steps={steps}", f"eval.sampling.samples_per_prompt={eval_samples}"]
    return cmd


def summary(world: str, name: str, seed: int, rows: list[dict], window: int) -> dict:
    train = [r for r in rows if REWARD[world] in r]
    reward = [r[REWARD[world]] for r in train]
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    line = {
        "world": world,
        "run": name,
        "seed": seed,
        "steps": len(train),
        "clock_s": round(sum(r["time/step_s"] for r in train), 1),
        "reward_first": round(statistics.fmean(reward[:window]), 4),
        "reward_last": round(statistics.fmean(reward[-window:]), 4),
    }
    if evals:
        pick = lambda r: {k[5:]: round(v, 4) for k, v in r.items() if k.startswith("eval/")}  # noqa: E731
        line.update(eval_first=pick(evals[0]), eval_last=pick(evals[-1]))
    explained = [r["critic/vf_explained_var"] for r in train if "critic/vf_explained_var" in r]
    if explained:
        line["vf_explained_var_last"] = round(statistics.fmean(explained[-window:]), 3)
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", choices=list(WORLDS), default="tiny")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=1)
    ap.add_argument("--only", default=None)
    ap.add_argument(
        "--eval-samples", type=int, default=4, help="shapes: held-out images per prompt (recipes: 4)"
    )
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "figures", "diffusion_ppo.jsonl"))
    args = ap.parse_args()
    world = WORLDS[args.world]
    names = (args.only or DEFAULT_RUNS[args.world]).split(",")
    jobs = [(n, int(s)) for s in args.seeds.split(",") for n in names]
    lines = []
    with tempfile.TemporaryDirectory() as root:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
        runs = []
        for name, seed in jobs:
            recipe, overrides = world[name]
            out = os.path.join(root, f"{name}_{seed}")
            cmd = command(
                args.world, recipe, overrides, args.steps, seed, args.threads, out, args.eval_samples
            )
            runs.append(Job((name, seed), cmd, out))
        for job, rows, _ in run_jobs(runs, args.parallel, env):
            lines.append(summary(args.world, *job.key, rows, args.window))
            print(json.dumps(lines[-1]), flush=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    print("| run | seeds | reward first | reward last (mean +- std) | eval last (strict, mean +- std) |")
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        mine = [r for r in lines if r["run"] == name]
        first = statistics.fmean(r["reward_first"] for r in mine)
        last = [r["reward_last"] for r in mine]
        strict = [r["eval_last"].get("accuracy_strict") for r in mine if "eval_last" in r]
        ev = (
            f"{statistics.fmean(strict):.3f} +- {statistics.pstdev(strict):.3f}"
            if strict and None not in strict
            else "-"
        )
        print(
            f"| {name} | {len(mine)} | {first:.4f} | {statistics.fmean(last):.4f} +- "
            f"{statistics.pstdev(last):.4f} | {ev} |"
        )


if __name__ == "__main__":
    main()
