"""PPO (a critic), GRPO and REINFORCE++ on the arithmetic world, one budget, several seeds.

Each run is its recipe (`llm/arith_ppo`, `llm/arith_grpo`, `llm/arith_reinforcepp`: 256 responses a
step, lr 1e-4) through the real entry point (`python -m unirl.train_vlm`, in-process, inband data
plane, `--threads` torch threads), `--parallel` at once (their clocks then share the cores). `seed`
moves the training problems, the sampling and PPO's value head; the held-out evaluation is fixed by
the recipes (`eval_all` seed 0, eval sampling seed 1234), so every run is scored on the same 241
unseen expressions and 200 held-out-combination problems, at step 0, every 50 steps and the last.

    python benchmarks/arith_algorithms.py [--steps 300] [--seeds 0,1,2] [--only ppo,grpo,reinforcepp]
        [--parallel 2] [--out benchmarks/results/arith_algorithms] [--reuse] [--summary-only]

Keeps each run under `--out/<algorithm>_<seed>/`. `--reuse` summarises a run there that already
reached `--steps` instead of running it again; a longer run is cut at `--steps`, which must then be
one of its evaluated steps (the recipes' lr is constant, so a run's first S steps are those of an
S-step run with the same seed: checked bit for bit over 20 steps). `--summary-only` runs nothing
and summarises the runs that reached `--steps` (naming the others on stderr). Appends one JSON line per run to `--out/summary.jsonl`
(wall clock, median step time, held-out accuracy at every evaluation, PPO's critic curve) and prints markdown tables:
mean and population std over seeds, the per-seed rows, the accuracy curves, PPO's value loss and
explained variance.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from runs import ROOT, Job, in_process_command, read_metrics, run_jobs  # noqa: E402

RECIPES = {"ppo": "llm/arith_ppo", "grpo": "llm/arith_grpo", "reinforcepp": "llm/arith_reinforcepp"}
EVAL = {  # the summary's name -> the run's metric
    "greedy": "eval/accuracy/greedy/holdout=expression",
    "pass@1": "eval/accuracy/pass@1/holdout=expression",
    "combination greedy": "eval/accuracy/greedy/holdout=combination",
}
CRITIC = {"vf_loss": "critic/vf_loss", "explained_var": "critic/vf_explained_var"}


def command(recipe: str, steps: int, seed: int, threads: int, out: str) -> list[str]:
    return in_process_command("unirl.train_vlm", recipe, steps, seed, threads, out)


def summary(name: str, seed: int, rows: list[dict], wall_s: float | None, window: int) -> dict:
    """One run's line: `evals` maps each evaluated step to the `EVAL` accuracies; `critic` (PPO) maps
    step 1 and each evaluated step after it to the mean of `CRITIC` over the `window` steps up to it."""
    train = [r for r in rows if "time/step_s" in r]
    evals = {r["step"]: {k: round(r[m], 4) for k, m in EVAL.items()} for r in rows if EVAL["greedy"] in r}
    line = {
        "algorithm": name,
        "seed": seed,
        "steps": len(train),
        "wall_s": None if wall_s is None else round(wall_s, 1),
        "clock_s": round(sum(r["time/step_s"] for r in train), 1),
        "step_s_median": round(statistics.median(r["time/step_s"] for r in train), 2),
        "evals": evals,
    }
    critic = {r["step"]: r for r in train if CRITIC["vf_loss"] in r}
    if critic:
        marks = [1] + [s for s in evals if s > 1]
        line["critic"] = {
            s: {
                k: round(statistics.fmean(critic[t][m] for t in range(max(1, s - window + 1), s + 1)), 4)
                for k, m in CRITIC.items()
            }
            for s in marks
        }
    return line


def spread(values: list[float]) -> str:
    return f"{statistics.fmean(values):.3f} ± {statistics.pstdev(values):.3f}"


def tables(lines: list[dict], names: list[str]) -> str:
    """Markdown: mean ± population std over seeds, per-seed rows, accuracy curves, PPO's critic."""
    out = [
        "| algorithm | seeds | wall clock (mean) | greedy, step 0 | greedy, last | pass@1, step 0 | "
        "pass@1, last | combinations greedy, step 0 | last |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        mine = [r for r in lines if r["algorithm"] == name]
        if not mine:
            continue
        first = [r["evals"][min(r["evals"])] for r in mine]
        last = [r["evals"][max(r["evals"])] for r in mine]
        walls = [r["wall_s"] for r in mine if r["wall_s"] is not None]
        wall = f"{statistics.fmean(walls) / 60:.1f} min" if walls else "-"
        cells = [f"{spread([e[k] for e in first])} | {spread([e[k] for e in last])}" for k in EVAL]
        out.append(f"| {name} | {len(mine)} | {wall} | " + " | ".join(cells) + " |")
    out += [
        "",
        "| algorithm | seed | steps | wall clock | median step | greedy | pass@1 | combinations greedy |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in sorted(lines, key=lambda r: (names.index(r["algorithm"]), r["seed"])):
        first, last = r["evals"][min(r["evals"])], r["evals"][max(r["evals"])]
        wall = "-" if r["wall_s"] is None else f"{r['wall_s'] / 60:.1f} min"
        cells = " | ".join(f"{first[k]:.3f} -> {last[k]:.3f}" for k in EVAL)
        out.append(
            f"| {r['algorithm']} | {r['seed']} | {r['steps']} | {wall} | {r['step_s_median']:.1f} s | {cells} |"
        )
    steps = sorted({s for r in lines for s in r["evals"]})
    out += ["", "| greedy (mean ± std) | " + " | ".join(f"step {s}" for s in steps) + " |"]
    out.append("|---|" + "---|" * len(steps))
    for name in names:
        mine = [r for r in lines if r["algorithm"] == name]
        if mine:
            cells = [spread([r["evals"][s]["greedy"] for r in mine if s in r["evals"]]) for s in steps]
            out.append(f"| {name} | " + " | ".join(cells) + " |")
    critics = [r for r in lines if "critic" in r]
    if critics:
        out += [
            "",
            "| PPO step | value loss (mean ± std) | explained variance (mean ± std) |",
            "|---|---|---|",
        ]
        for s in sorted({s for r in critics for s in r["critic"]}):
            at = [r["critic"][s] for r in critics if s in r["critic"]]
            out.append(
                f"| {s} | {spread([c['vf_loss'] for c in at])} | {spread([c['explained_var'] for c in at])} |"
            )
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--only", default="ppo,grpo,reinforcepp")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parallel", type=int, default=2)
    ap.add_argument("--window", type=int, default=10, help="steps averaged into each critic point")
    ap.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results", "arith_algorithms"))
    ap.add_argument(
        "--reuse", action="store_true", help="summarise runs in --out that reached --steps (cut there)"
    )
    ap.add_argument(
        "--summary-only", action="store_true", help="run nothing; summarise (--reuse) what is in --out"
    )
    args = ap.parse_args()
    args.reuse |= args.summary_only
    names = args.only.split(",")
    unknown = sorted(set(names) - set(RECIPES))
    if unknown:
        sys.exit(f"--only: unknown algorithm(s) {unknown}; choose from {sorted(RECIPES)}")
    os.makedirs(args.out, exist_ok=True)
    record = os.path.join(args.out, "summary.jsonl")
    walls = {}  # a reused run's wall clock, from its line in an earlier summary
    if os.path.exists(record):
        with open(record) as f:
            walls = {(r["algorithm"], r["seed"], r["steps"]): r["wall_s"] for r in map(json.loads, f) if r}
    lines, jobs = [], []
    for seed in (int(s) for s in args.seeds.split(",")):
        for name in names:
            out = os.path.join(args.out, f"{name}_{seed}")
            done = args.reuse and os.path.exists(os.path.join(out, "metrics.jsonl"))
            rows = [r for r in read_metrics(out) if r["step"] <= args.steps] if done else []
            if rows and rows[-1]["step"] == args.steps and EVAL["greedy"] in rows[-1]:
                lines.append(summary(name, seed, rows, walls.get((name, seed, args.steps)), args.window))
            elif args.summary_only:
                print(f"{name} seed {seed}: no evaluated step {args.steps} in {out}", file=sys.stderr)
            else:
                jobs.append(
                    Job((name, seed), command(RECIPES[name], args.steps, seed, args.threads, out), out)
                )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    with open(record, "a") as f:
        for job, rows, wall in run_jobs(jobs, args.parallel, env):
            lines.append(summary(*job.key, rows, wall, args.window))
            f.write(json.dumps(lines[-1]) + "\n")
            f.flush()
            print(json.dumps(lines[-1]), flush=True)
    print(tables(lines, names))


if __name__ == "__main__":
    main()
