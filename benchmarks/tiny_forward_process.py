"""Reward vs training wall clock on the tiny redness world: Flow-GRPO against the forward-process
losses (AWM, DiffusionNFT, DGPO, CRD), with random-reward controls.

Each run is its recipe through the real entry point (`python -m unirl.train_diffusion`,
in-process, inband data plane, `--threads` torch threads), `--steps` steps, one after another
(run nothing else beside them if the clocks are to be compared). The clock is the sum of the
rows' `time/step_s` (rollout + reward + train). The target is Flow-GRPO's reward at its last
step, the mean of `reward/redness/mean` over its last `--window` steps; a run reaches it at the
first step whose trailing `--window`-step mean is at least that, and its clock there is
compared with Flow-GRPO's whole clock. A control trains on `RandomReward` (the redness reward
logged at weight 0), so a rise there is not learning from the reward.

    python benchmarks/tiny_forward_process.py [--steps 30] [--window 5] [--threads 1]
        [--only flowgrpo,awm,...] [--reference TARGET,CLOCK_S] [--out benchmarks/figures/tiny_forward_process.jsonl]

Writes one JSON line per run (`run, steps, clock_s, reward_first, reward_last, reached_step,
reached_clock_s, clock_ratio`) and prints them as a table.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RANDOM_REWARD = [
    "+reward.backend.components.random._target_=unirl.reward.local.RandomReward",
    "+reward.backend.weights.random=1.0",
    "reward.backend.weights.redness=0.0",
]
NFT = [  # tiny_awm's world and budget with DiffusionNFT's loss (ODE rollouts, no EMA)
    "algorithm._target_=unirl.algorithms.diffusion_nft.DiffusionNFT",
    "~algorithm.config",
    "+algorithm.config._target_=unirl.algorithms.diffusion_nft.DiffusionNFTConfig",
    "+algorithm.config.draws_per_sample=2",
    "train.ema=null",
]
RUNS: dict[str, tuple[str, list[str]]] = {
    "flowgrpo": ("diffusion/tiny_sd3_flowgrpo", []),
    "awm": ("diffusion/tiny_awm", []),
    "awm_uniform": ("diffusion/tiny_awm", ["algorithm.config.weighting=uniform"]),
    "awm_kl0.01": ("diffusion/tiny_awm", ["algorithm.config.ema_kl_beta=0.01"]),
    "awm_unconstrained": (
        "diffusion/tiny_awm",
        ["algorithm.config.ema_kl_beta=0.0", "+algorithm.config.allow_unconstrained=true", "train.ema=null"],
    ),
    "nft": ("diffusion/tiny_awm", NFT),
    "dgpo": ("diffusion/tiny_dgpo", []),
    "crd": ("diffusion/tiny_crd", []),
    "crd_kl0.01": ("diffusion/tiny_crd", ["algorithm.config.kl_beta=0.01"]),
    "crd_kl0.001": ("diffusion/tiny_crd", ["algorithm.config.kl_beta=0.001"]),
    "crd_kl0.01_plain_logp": (
        "diffusion/tiny_crd",
        ["algorithm.config.kl_beta=0.01", "algorithm.config.adaptive_logp=false"],
    ),
    "crd_lr6e-3": ("diffusion/tiny_crd", ["train.optim.lr=6e-3"]),
    "dgpo_lr6e-3": ("diffusion/tiny_dgpo", ["train.optim.lr=6e-3"]),
    "control_random_awm": ("diffusion/tiny_awm", RANDOM_REWARD),
    "control_random_dgpo": ("diffusion/tiny_dgpo", RANDOM_REWARD),
    "control_random_crd": ("diffusion/tiny_crd", RANDOM_REWARD),
    "control_random_flowgrpo": ("diffusion/tiny_sd3_flowgrpo", RANDOM_REWARD),
    "control_random_dgpo_lr6e-3": ("diffusion/tiny_dgpo", ["train.optim.lr=6e-3", *RANDOM_REWARD]),
    "flowgrpo_lr6e-3": ("diffusion/tiny_sd3_flowgrpo", ["train.optim.lr=6e-3"]),
}
REWARD = "reward/redness/mean"


def train(recipe: str, overrides: list[str], steps: int, threads: int) -> list[dict]:
    """The rows of one run of `recipe` through the entry point."""
    with tempfile.TemporaryDirectory() as out:
        cmd = [
            sys.executable,
            "-m",
            "unirl.train_diffusion",
            f"--config-name={recipe}",
            "++launcher=in_process",
            "transport=inband",
            "num_devices=1",
            f"threads_per_worker={threads}",
            f"num_steps={steps}",
            f"output_dir={out}",
            "logging.progress=false",
            "logging.save_images_every=0",
            *overrides,
        ]
        subprocess.run(cmd, cwd=ROOT, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if line.strip()]


def curve(rows: list[dict]) -> tuple[list[float], list[float]]:
    """(cumulative training clock, redness reward) per step."""
    clock, t, reward = [], 0.0, []
    for r in rows:
        t += r["time/step_s"]
        clock.append(t)
        reward.append(r[REWARD])
    return clock, reward


def trailing(values: list[float], window: int) -> list[float]:
    return [
        sum(values[max(0, i - window + 1) : i + 1]) / len(values[max(0, i - window + 1) : i + 1])
        for i in range(len(values))
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--window", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--only", default=",".join(RUNS))
    ap.add_argument(
        "--reference",
        default=None,
        help="TARGET,CLOCK_S of an earlier Flow-GRPO run (same machine and load): skip running it",
    )
    ap.add_argument(
        "--out", default=os.path.join(ROOT, "benchmarks", "figures", "tiny_forward_process.jsonl")
    )
    args = ap.parse_args()
    names = args.only.split(",")
    if "flowgrpo" not in names and args.reference is None:
        names = ["flowgrpo", *names]
    curves = {}
    for name in names:
        recipe, overrides = RUNS[name]
        curves[name] = curve(train(recipe, overrides, args.steps, args.threads))
    if args.reference is None:
        clock_ref, reward_ref = curves["flowgrpo"]
        target, ref_clock = trailing(reward_ref, args.window)[-1], clock_ref[-1]
    else:
        target, ref_clock = (float(v) for v in args.reference.split(","))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    lines = []
    for name in names:
        clock, reward = curves[name]
        smooth = trailing(reward, args.window)
        reached = next((i for i, v in enumerate(smooth) if i >= args.window - 1 and v >= target), None)
        lines.append(
            {
                "run": name,
                "steps": len(reward),
                "clock_s": round(clock[-1], 2),
                "reward_first": round(trailing(reward[: args.window], args.window)[-1], 4),
                "reward_last": round(smooth[-1], 4),
                "target": round(target, 4),
                "reached_step": None if reached is None else reached + 1,
                "reached_clock_s": None if reached is None else round(clock[reached], 2),
                "clock_ratio": None if reached is None else round(clock[reached] / ref_clock, 3),
            }
        )
    with open(args.out, "a") as f:
        for line in lines:
            f.write(json.dumps(line) + "\n")
    print(
        "| run | steps | clock s | reward first | reward last | reaches FlowGRPO's at step | clock there s | / FlowGRPO clock |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in lines:
        print(
            f"| {r['run']} | {r['steps']} | {r['clock_s']} | {r['reward_first']} | {r['reward_last']} | "
            f"{r['reached_step']} | {r['reached_clock_s']} | {r['clock_ratio']} |"
        )


if __name__ == "__main__":
    main()
