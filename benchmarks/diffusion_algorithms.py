"""One wall-clock budget on the shapes world for every diffusion algorithm the project has.

Each algorithm is its recipe `examples/diffusion/shapes_<name>.yaml` (GRPO-Guard: Flow-GRPO's
with `+algorithm.config.guard=true`) on the committed base
(`checkpoints/shapes_sd3`), run through the real entry point (`python -m
unirl.train_diffusion`, in-process, inband data plane, `--threads` torch threads) with a
held-out evaluation every `--eval-every` steps (the recipes' own: 51 held-out prompts x 4
fixed seeds, strict GenEval-mini by the weight-free scorer). A run is stopped at the first
evaluation after `--budget-min` minutes of *training* wall clock (the sum of the rows'
`time/step_s`: rollout + reward + train; evaluation time is not charged, it is the same
for every algorithm). The controls are Flow-GRPO, GRPO-Guard, DGPO, CRD and AWM trained on `RandomReward`
(the real reward logged at weight 0).

    python benchmarks/diffusion_algorithms.py [--budget-min 5] [--eval-every 5] [--threads 2]
        [--only flowgrpo,nft,...] [--out benchmarks/results/diffusion_algorithms.jsonl]
        [--plot benchmarks/results/diffusion_algorithms.png]

Writes one JSON line per evaluation (`algorithm, step, train_s, strict` plus per-category
accuracies), prints a markdown table (strict at step 0, at half the budget and at the end,
change vs the base) and draws held-out strict accuracy vs training wall clock (PNG, needs
matplotlib: `pip install matplotlib`). Runs are sequential; run nothing else beside them
if the wall clocks are to be compared.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")

RANDOM_REWARD = [
    "+reward.backend.components.random._target_=unirl.reward.local.RandomReward",
    "+reward.backend.weights.random=1.0",
]

ALGORITHMS: dict[str, tuple[str, list[str]]] = {
    # name: (recipe, extra overrides)
    "flowgrpo": ("diffusion/shapes_flowgrpo", []),
    "flowgrpo_guard": ("diffusion/shapes_flowgrpo", ["+algorithm.config.guard=true"]),  # GRPO-Guard
    "nft": ("diffusion/shapes_nft", []),
    "awm": ("diffusion/shapes_awm", []),
    "dancegrpo": ("diffusion/shapes_dancegrpo", []),
    "mixgrpo": ("diffusion/shapes_mixgrpo", []),
    "flowdppo": ("diffusion/shapes_flowdppo", []),
    "ddpo": ("diffusion/shapes_ddpo", []),
    "dpok": ("diffusion/shapes_dpok", []),
    "diffusiondpo": ("diffusion/shapes_diffusiondpo", []),
    "draft": ("diffusion/shapes_draft", []),
    "alignprop": ("diffusion/shapes_alignprop", []),
    "refl": ("diffusion/shapes_refl", []),
    "dgpo": ("diffusion/shapes_dgpo", []),
    "crd": ("diffusion/shapes_crd", []),
    "crd_kl0.01": ("diffusion/shapes_crd", ["algorithm.config.kl_beta=0.01"]),
    "control_random": ("diffusion/shapes_flowgrpo", RANDOM_REWARD),
    "control_random_dgpo": ("diffusion/shapes_dgpo", RANDOM_REWARD),
    "control_random_crd": ("diffusion/shapes_crd", RANDOM_REWARD),
    "control_random_awm": ("diffusion/shapes_awm", RANDOM_REWARD),
    "control_random_guard": ("diffusion/shapes_flowgrpo", ["+algorithm.config.guard=true", *RANDOM_REWARD]),
}


def control_overrides(recipe_yaml: str) -> list[str]:
    """Zero the weight of every real reward component of `recipe_yaml` (they stay logged)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(recipe_yaml)
    weights = OmegaConf.select(cfg, "reward.backend.weights") or {}
    return [f"reward.backend.weights.{k}=0.0" for k in weights]


def eval_rows(metrics_path: str) -> list[dict]:
    """One dict per evaluated row of a run's metrics.jsonl: its step, the training seconds so
    far, its `eval/...` values, and `train_reward/<component>`: the mean over the training steps
    since the previous evaluation of every logged reward component (`reward/<c>/mean`; a
    zero-weight monitor such as the weight-free scorer included, so a learned reward can be
    read against the true one)."""
    if not os.path.exists(metrics_path):
        return []
    out, train_s, since = [], 0.0, {}
    with open(metrics_path) as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            train_s += float(row.get("time/step_s", 0.0))
            for k, v in row.items():
                parts = k.split("/")
                if len(parts) == 3 and parts[0] == "reward" and parts[2] == "mean":
                    since.setdefault(parts[1], []).append(float(v))
            ev = {k[len("eval/") :]: v for k, v in row.items() if k.startswith("eval/")}
            if ev:
                rewards = {f"train_reward/{c}": sum(v) / len(v) for c, v in since.items()}
                out.append({"step": row["step"], "train_s": train_s, **ev, **rewards})
                since = {}
    return out


def run_one(name: str, budget_s: float, eval_every: int, threads: int, workdir: str) -> list[dict]:
    """Run algorithm `name` until its first evaluation past `budget_s` training seconds."""
    recipe, extra = ALGORITHMS[name]
    if name.startswith("control"):
        extra = extra + control_overrides(os.path.join(ROOT, "examples", recipe + ".yaml"))
    out_dir = os.path.join(workdir, name)
    cmd = [
        sys.executable, "-m", "unirl.train_diffusion", f"--config-name={recipe}",
        "++launcher=in_process", "transport=inband", f"threads_per_worker={threads}",
        "num_steps=100000", f"eval.every_n_steps={eval_every}", f"output_dir={out_dir}",
        "logging.save_images_every=0", "logging.progress=false", *extra,
    ]  # fmt: skip
    log = open(os.path.join(workdir, f"{name}.log"), "w")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )
    metrics = os.path.join(out_dir, "metrics.jsonl")
    try:
        while proc.poll() is None:
            rows = eval_rows(metrics)
            if rows and rows[-1]["train_s"] >= budget_s:
                break
            time.sleep(2)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        log.close()
    rows = eval_rows(metrics)
    if proc.returncode not in (0, -signal.SIGTERM, None) and not rows:
        raise RuntimeError(f"{name}: the run failed (exit {proc.returncode}); see {log.name}")
    return [{"algorithm": name, "recipe": recipe, **r} for r in rows]


def at(rows: list[dict], seconds: float) -> dict:
    """The last evaluation at or before `seconds` of training."""
    before = [r for r in rows if r["train_s"] <= seconds + 1e-9]
    return before[-1] if before else rows[0]


def table(results: dict[str, list[dict]], budget_s: float) -> str:
    lines = [
        "| algorithm | steps | strict: base | at half budget | at budget | change "
        "| two_objects | counting | position |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in results.items():
        if not rows:
            lines.append(f"| {name} | - | - | - | - | failed | - | - | - |")
            continue
        base, half, end = rows[0], at(rows, budget_s / 2), rows[-1]
        lines.append(
            f"| {name} | {end['step']} | {base['accuracy_strict']:.3f} | {half['accuracy_strict']:.3f} "
            f"| {end['accuracy_strict']:.3f} ({end['train_s'] / 60:.1f} min) "
            f"| {end['accuracy_strict'] - base['accuracy_strict']:+.3f} | "
            + " | ".join(
                f"{base.get(f'accuracy/{c}', float('nan')):.3f} -> {end.get(f'accuracy/{c}', float('nan')):.3f}"
                for c in ("two_objects", "counting", "position")
            )
            + " |"
        )
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: str) -> None:
    """Left: held-out strict accuracy vs training wall clock, every run. Right, for the runs
    trained on the learned reward (a `train_reward/learned` column): that reward and the
    weight-free scorer (`train_reward/strict`) on the same training samples, so reward hacking
    shows as the two curves parting."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    learned = {n: rows for n, rows in results.items() if rows and "train_reward/learned" in rows[-1]}
    fig, axes = plt.subplots(
        1, 2 if learned else 1, figsize=(13 if learned else 7, 4.5), dpi=120, squeeze=False
    )
    ax = axes[0][0]
    ax.set_prop_cycle(color=plt.cm.tab20.colors[::2] + plt.cm.tab20.colors[1::2])  # 20 distinct colours
    for name, rows in results.items():
        if rows:
            style = "--" if name.startswith("control") else "-"
            ax.plot([r["train_s"] / 60 for r in rows], [r["accuracy_strict"] for r in rows], style, marker="o",
                    markersize=3, label=name)  # fmt: skip
    ax.set_xlabel("training wall clock (min, 2 CPU cores)")
    ax.set_ylabel("held-out strict accuracy (weight-free scorer)")
    ax.set_title("Shapes world: diffusion algorithms on one budget")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    if learned:
        ax = axes[0][1]
        for name, rows in learned.items():
            rows = [r for r in rows if "train_reward/learned" in r]
            t = [r["train_s"] / 60 for r in rows]
            (line,) = ax.plot(t, [r["train_reward/learned"] for r in rows], "-", marker="o", markersize=3,
                              label=f"{name}: learned reward")  # fmt: skip
            if all("train_reward/strict" in r for r in rows):
                ax.plot(t, [r["train_reward/strict"] for r in rows], ":", marker="x", markersize=3,
                        color=line.get_color(), label=f"{name}: weight-free scorer")  # fmt: skip
        ax.set_xlabel("training wall clock (min, 2 CPU cores)")
        ax.set_ylabel("mean reward on the training samples")
        ax.set_title("Learned reward vs the true scorer (reward hacking shows as a gap)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--budget-min", type=float, default=5.0)
    ap.add_argument("--eval-every", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(ALGORITHMS))
    ap.add_argument("--out", default=os.path.join(RESULTS, "diffusion_algorithms.jsonl"))
    ap.add_argument("--plot", default=os.path.join(RESULTS, "diffusion_algorithms.png"))
    ap.add_argument("--workdir", default=None, help="run outputs (default: a temporary directory)")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(ALGORITHMS)
    unknown = [n for n in names if n not in ALGORITHMS]
    if unknown:
        ap.error(f"--only: unknown algorithm(s) {unknown}; known: {sorted(ALGORITHMS)}")
    missing = [
        n for n in names if not os.path.exists(os.path.join(ROOT, "examples", ALGORITHMS[n][0] + ".yaml"))
    ]
    if missing:
        ap.error(f"no recipe for {missing} (examples/<recipe>.yaml)")
    workdir = args.workdir or tempfile.mkdtemp(prefix="unirl_diffusion_algorithms_")
    os.makedirs(workdir, exist_ok=True)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    results: dict[str, list[dict]] = {}
    for name in names:
        t0 = time.perf_counter()
        try:
            rows = run_one(name, args.budget_min * 60, args.eval_every, args.threads, workdir)
        except RuntimeError as exc:
            print(f"{name}: {exc}", file=sys.stderr)
            rows = []
        results[name] = rows
        with open(args.out, "a") as f:
            for r in rows:
                f.write(json.dumps({**r, "budget_min": args.budget_min, "threads": args.threads}) + "\n")
        last = rows[-1]["accuracy_strict"] if rows else float("nan")
        print(
            f"{name}: {len(rows)} evaluations, strict {last:.3f}, {time.perf_counter() - t0:.0f} s wall",
            flush=True,
        )
    print(table(results, args.budget_min * 60))
    if not any(results.values()):
        sys.exit("no run produced an evaluation")
    try:
        plot(results, args.plot)
        print(f"plot: {args.plot}")
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)


if __name__ == "__main__":
    main()
