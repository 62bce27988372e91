"""Graphs kept from sampling vs replay on the on-policy path: step time side by side, and memory.

On the on-policy path (one update per rollout) the replay forward of a trained
SDE step repeats the sampling forward at the same weights and inputs.
`rollout.keep_graph: true` keeps the graphs of those sampling forwards and the
loss backpropagates through them instead of replaying. This benchmark runs a
recipe both ways in one process, side by side:

- two in-process `RLWorker`s built from the same recipe (same seed, same
  initial weights), one with `rollout.keep_graph=false` (replay) and one with
  `rollout.keep_graph=true`, each with its own inband data plane, data source,
  reward and advantage config;
- each step runs the driver's phases on both, alternating which side goes
  first: rollout (`rollout`), reward (fetch the media, score, advantages) and
  train (`train`: replay or kept graphs, backward, optimizer step), the same
  worker calls the trainer makes;
- the first `--warmup` steps are dropped; the ratio is keep_graph / replay of
  each step's wall time, reported as the median over steps (and of the phase
  medians).

Memory, measured apart (peak RSS is per process): `--memory` runs each side
in a subprocess for `--memory-steps` steps and reports its peak RSS
(`ru_maxrss`), and one extra rollout of the keep_graph side counts the bytes
autograd saved for backward (`saved_tensors_hooks`), i.e. what the kept graphs
hold, per kept (sample, step) pair.

    python benchmarks/keep_graph.py [--recipe diffusion/tiny_sd3_flowgrpo] [--steps 10] [--memory] [key=value ...]

Writes JSON lines (stdout and `--out`): one per phase (medians, ratio), one
summary (the step-time ratio against the 0.75 goal, memory).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from unirl.config.validate import validate_rl_config  # noqa: E402
from unirl.dataplane import get_batch, make_transport  # noqa: E402
from unirl.distributed.group import in_process  # noqa: E402
from unirl.trainer.modality import modality_for  # noqa: E402
from unirl.trainer.worker import RLWorker, build, quiet_library_logs  # noqa: E402

EXAMPLES = os.path.join(REPO, "examples")
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "keep_graph.jsonl")
SIDES = ("replay", "keep_graph")
PHASES = ("rollout", "reward", "train", "step")
GOAL = 0.75


def compose_side(recipe: str, overrides: list[str], side: str) -> DictConfig:
    """The recipe as one in-process worker runs it, with `rollout.keep_graph` for `side`."""
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        cfg = compose(
            config_name=recipe,
            overrides=[
                *overrides,
                "launcher=in_process",
                "transport=inband",
                "num_devices=1",
                "logging.progress=false",
                f"++rollout.keep_graph={side == 'keep_graph'}",
            ],
        )
    validate_rl_config(cfg, expect="diffusion")
    return cfg


class Side:
    """One worker and the driver-side pieces of one recipe (what `Trainer` holds)."""

    def __init__(self, name: str, cfg: DictConfig, num_steps: int) -> None:
        self.name = name
        self.cfg = cfg
        self.transport = make_transport(cfg.transport)
        plain = OmegaConf.to_container(cfg, resolve=True)
        plain.pop("hydra", None)
        self.group = in_process(RLWorker, plain, num_steps, None, self.transport.start())
        self.data_source = build(cfg.data_source)
        self.reward = build(cfg.reward)
        self.advantage = build(cfg.advantage)
        self.modality = modality_for(build(cfg.sampling), self.group.model_info())
        self.num_steps = num_steps

    def step(self, step: int) -> dict[str, float]:
        """One driver step (rollout, reward, advantages, train); phase wall times and metrics."""
        partition = f"{self.name}_step_{step}"
        prompts = int(self.cfg.prompts_per_rollout)
        t0 = time.perf_counter()
        try:
            req = self.modality.request(self.data_source.next_batch(prompts), step)
            meta = self.group.rollout(req, partition)
            t1 = time.perf_counter()
            track = get_batch(self.transport, meta, self.modality.reward_fields)
            self.reward.score_and_attach(track)
            track.compute_advantages(self.advantage)
            t2 = time.perf_counter()
            metrics = self.group.train(
                self.transport.claim(meta, "train"), track.rewards, track.advantages, step / self.num_steps
            )
            t3 = time.perf_counter()
        finally:
            self.transport.clear(partition)
        row = metrics[0] if isinstance(metrics, list) else metrics
        return {
            "rollout": t1 - t0,
            "reward": t2 - t1,
            "train": t3 - t2,
            "step": t3 - t0,
            "loss": float(row["loss"]),
            "reward_mean": float(track.rewards.mean()),
            "kept_fraction": float(row.get("keep_graph/kept_fraction", 0.0)),
        }

    def close(self) -> None:
        self.group.teardown()
        self.group.shutdown()
        self.transport.close()


def saved_bytes_per_pair(side: Side, step: int) -> dict[str, float]:
    """Bytes autograd saves for backward during one training rollout of `side` (what the kept
    graphs hold), in total and per kept (sample, step) pair; the graphs are dropped after."""
    seen: dict[tuple[int, int], int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            key = (t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            seen[key] = t.untyped_storage().nbytes()
        return t

    partition = f"memory_{step}"
    prompts = int(side.cfg.prompts_per_rollout)
    req = side.modality.request(side.data_source.next_batch(prompts), step)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        side.group.rollout(req, partition)
    pairs = len(side.group.worker.kept)
    side.group.release_kept(partition)
    side.transport.clear(partition)
    total = sum(seen.values())
    return {
        "kept_pairs": pairs,
        "saved_mb": round(total / 2**20, 2),
        "saved_mb_per_pair": round(total / 2**20 / pairs, 4) if pairs else None,
    }


def peak_rss_of(side: str, args: argparse.Namespace) -> float:
    """Peak RSS (MiB) of a subprocess that runs `side` for `--memory-steps` steps."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "--recipe",
        args.recipe,
        "--memory-side",
        side,
        "--memory-steps",
        str(args.memory_steps),
        *args.overrides,
    ]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env={**os.environ}).stdout
    return float(json.loads(out.strip().splitlines()[-1])["peak_rss_mb"])


def run_memory_side(args: argparse.Namespace) -> int:
    """Child of `--memory`: run one side, print its peak RSS."""
    quiet_library_logs()
    cfg = compose_side(args.recipe, args.overrides, args.memory_side)
    side = Side(args.memory_side, cfg, args.memory_steps)
    for step in range(args.memory_steps):
        side.step(step)
    side.close()
    print(
        json.dumps(
            {
                "side": args.memory_side,
                "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            }
        )
    )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="diffusion/tiny_sd3_flowgrpo")
    parser.add_argument("--steps", type=int, default=10, help="steps per side, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps dropped")
    parser.add_argument("--memory", action="store_true", help="also measure each side's peak RSS apart")
    parser.add_argument("--memory-steps", type=int, default=3)
    parser.add_argument("--memory-side", choices=SIDES, help=argparse.SUPPRESS)
    parser.add_argument("--out", default=DEFAULT_OUT)
    parser.add_argument("overrides", nargs="*", help="Hydra key=value overrides of the recipe")
    args = parser.parse_args(argv)
    if args.memory_side:
        return run_memory_side(args)
    if args.steps <= args.warmup:
        parser.error("--steps must exceed --warmup")
    quiet_library_logs()
    sides = {name: Side(name, compose_side(args.recipe, args.overrides, name), args.steps) for name in SIDES}
    per_step: dict[str, list[dict[str, float]]] = {name: [] for name in SIDES}
    for step in range(args.steps):
        order = SIDES if step % 2 == 0 else SIDES[::-1]
        for name in order:
            per_step[name].append(sides[name].step(step))
    memory = saved_bytes_per_pair(sides["keep_graph"], args.steps)
    for side in sides.values():
        side.close()
    kept = {name: rows[args.warmup :] for name, rows in per_step.items()}
    common = {
        "bench": "keep_graph",
        "recipe": args.recipe,
        "overrides": args.overrides,
        "steps": args.steps,
        "warmup": args.warmup,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }
    lines = []
    for phase in PHASES:
        replay = [r[phase] for r in kept["replay"]]
        keep = [r[phase] for r in kept["keep_graph"]]
        lines.append(
            {
                **common,
                "phase": phase,
                "replay_s": round(statistics.median(replay), 4),
                "keep_graph_s": round(statistics.median(keep), 4),
                "ratio": round(statistics.median(keep) / statistics.median(replay), 3),
                "replay_per_step_s": [round(v, 4) for v in replay],
                "keep_graph_per_step_s": [round(v, 4) for v in keep],
            }
        )
    pair_ratios = [k["step"] / r["step"] for k, r in zip(kept["keep_graph"], kept["replay"], strict=True)]
    summary: dict[str, Any] = {
        **common,
        "phase": "summary",
        "step_ratio_median_of_pairs": round(statistics.median(pair_ratios), 3),
        "step_ratio_of_medians": lines[-1]["ratio"],
        "goal": GOAL,
        "goal_met": statistics.median(pair_ratios) <= GOAL,
        "kept_fraction": statistics.mean(r["kept_fraction"] for r in kept["keep_graph"]),
        "loss_replay": [round(r["loss"], 6) for r in per_step["replay"]],
        "loss_keep_graph": [round(r["loss"], 6) for r in per_step["keep_graph"]],
        "reward_replay": [round(r["reward_mean"], 4) for r in per_step["replay"]],
        "reward_keep_graph": [round(r["reward_mean"], 4) for r in per_step["keep_graph"]],
        **memory,
    }
    if args.memory:
        summary["peak_rss_mb"] = {name: round(peak_rss_of(name, args), 1) for name in SIDES}
    lines.append(summary)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        for line in lines:
            text = json.dumps(line)
            print(text)
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
