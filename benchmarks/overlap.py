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

`--suite partial`: partial rollouts on the tiny LM (`llm/tiny_lm_dedicated`, one separate engine,
16 new tokens at most) instead: `stale_1` and `stale_2` (`max_staleness` 1, 2), `partial_2`
(`max_staleness` 2 with `partial_tokens` 4: every step syncs, rollouts in flight pause after 4
tokens a segment and resume by the new weights). Rows add the mean version lag of the sampled
tokens (`token_staleness`; without partial rollouts a rollout's lag), the share of samples resumed
across a sync, the first update's approximate KL between the trained and the behaviour policy, and
the reward over the last steps of each round.

Output: JSON lines on stdout and appended to `--out`.

    python benchmarks/overlap.py [--suite diffusion|partial] [--steps 12] [--repeats 2] [--out FILE]
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
LM = "llm/tiny_lm_dedicated"
LM_STALE = ["rollout.placement=separate", "rollout.sleep_level=0", "algorithm.config.old_logp_source=rollout"]
PARTIAL = {
    "stale_1": (LM, [*LM_STALE, "rollout.max_staleness=1"]),
    "stale_2": (LM, [*LM_STALE, "rollout.max_staleness=2"]),
    "partial_2": (LM, [*LM_STALE, "rollout.max_staleness=2", "rollout.partial_tokens=4"]),
}
SUITES = {"diffusion": CONFIGS, "partial": PARTIAL}
WARMUP = 2


def run(configs: dict, name: str, steps: int) -> list[dict]:
    recipe, overrides = configs[name]
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
    parser.add_argument("--suite", choices=sorted(SUITES), default="diffusion")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "overlap.jsonl"))
    args = parser.parse_args()
    if args.steps <= WARMUP:
        parser.error(f"--steps must exceed the {WARMUP} warm-up steps")
    configs = SUITES[args.suite]
    timed: dict[str, list[dict]] = {name: [] for name in configs}
    ray.init(address="local", num_cpus=4, include_dashboard=False, _node_ip_address="127.0.0.1")
    try:
        for _ in range(args.repeats):
            for name in configs:
                timed[name] += run(configs, name, args.steps)[WARMUP:]
    finally:
        ray.shutdown()
    if args.suite == "partial":
        lines = [partial_line(name, rows, args.steps - WARMUP) for name, rows in timed.items()]
        write(lines, args.out)
        return
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
    write(lines, args.out)


def partial_line(name: str, rows: list[dict], per_round: int) -> dict:
    """A partial-rollout suite row: step time, version lag of the tokens, resumed samples, and
    the reward of the last 5 timed steps of every round."""
    lag = [r.get("rollout/token_staleness_mean", r["rollout/staleness"]) for r in rows]
    last = [r["reward/mean"] for k, r in enumerate(rows) if k % per_round >= per_round - 5]
    return {
        "bench": "overlap_partial",
        "config": name,
        "steps_timed": len(rows),
        "step_s": statistics.median(r["time/step_s"] for r in rows),
        "rollout_wait_s": statistics.median(r["time/rollout_s"] for r in rows),
        "token_staleness": statistics.mean(lag),
        "resumed_frac": statistics.mean(r.get("rollout/resumed_frac", 0.0) for r in rows),
        "approx_kl": statistics.mean(r["approx_kl"] for r in rows),  # behaviour vs trained policy
        "reward_last5": statistics.mean(last),
    }


def write(lines: list[dict], out: str) -> None:
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "a") as f:
        for line in lines:
            print(json.dumps(line))
            f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
