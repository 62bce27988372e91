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
- each phase is timed in wall time and in this process's CPU time (all
  threads; less disturbed than wall time when other jobs share the cores);
- the first `--warmup` steps are dropped; a ratio is keep_graph / replay,
  as the median over steps of each step pair's ratio, of the medians and of
  the minima.

Memory, measured apart (peak RSS is per process): `--memory` runs each side
in a subprocess, resets the peak-RSS mark after a warm-up step and reports the
RSS before and the peak during `--memory-steps` steps; and one extra rollout
of the keep_graph side here counts the bytes autograd saves for backward
(`saved_tensors_hooks`; weights excluded, they are not copied), i.e. what the
kept graphs hold, per kept (sample, step) pair.

    python benchmarks/keep_graph.py [--recipe diffusion/tiny_sd3_flowgrpo] [--steps 12] [--memory] [key=value ...]

Writes JSON lines (stdout and `--out`): one per phase, one summary (the step
ratio against the 0.75 goal, loss and reward per step of both sides, memory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# as in the trainer's Ray workers (unirl.trainer.trainer.WORKER_ENV; read when torch loads): large
# CPU tensors, such as the kept graphs' activations, on transparent huge pages
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

from unirl.algorithms.advantages import track_advantages  # noqa: E402
from unirl.config.validate import validate_recipe  # noqa: E402
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
                "++launcher=in_process",
                "transport=inband",
                "num_devices=1",
                "logging.progress=false",
                f"++rollout.keep_graph={side == 'keep_graph'}",
            ],
        )
    validate_recipe(cfg, expect="diffusion")
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
        """One driver step (rollout, reward, advantages, train): phase wall and CPU times, metrics."""
        partition = f"{self.name}_step_{step}"
        prompts = int(self.cfg.prompts_per_rollout)
        marks = [(time.perf_counter(), time.process_time())]
        try:
            req = self.modality.request(self.data_source.next_batch(prompts), step)
            meta = self.group.rollout(req, partition)
            marks.append((time.perf_counter(), time.process_time()))
            track = get_batch(self.transport, meta, self.modality.reward_fields)
            self.reward.score_and_attach(track)
            track_advantages(track, self.advantage)
            marks.append((time.perf_counter(), time.process_time()))
            metrics = self.group.train(
                self.transport.claim(meta, "train"), track.rewards, track.advantages, step / self.num_steps
            )
            marks.append((time.perf_counter(), time.process_time()))
        finally:
            self.transport.clear(partition)
        out = {}
        for k, phase in enumerate(PHASES[:3]):
            out[phase] = marks[k + 1][0] - marks[k][0]
            out[f"{phase}_cpu"] = marks[k + 1][1] - marks[k][1]
        out["step"], out["step_cpu"] = marks[-1][0] - marks[0][0], marks[-1][1] - marks[0][1]
        row = metrics[0]
        out.update(
            loss=float(row["loss"]),
            reward_mean=float(track.rewards.mean()),
            kept_fraction=float(row.get("keep_graph/kept_fraction", 0.0)),
        )
        return out

    def close(self) -> None:
        self.group.teardown()
        self.group.shutdown()
        self.transport.close()


def saved_bytes_per_pair(side: Side, step: int) -> dict[str, float]:
    """Bytes autograd saves for backward during one training rollout of `side` (what the kept
    graphs hold; weights excluded), in total and per kept (sample, step) pair; the graphs
    are dropped after."""
    seen: dict[tuple[int, int], int] = {}
    module = side.group.worker.stage.module
    weights = {t.untyped_storage().data_ptr() for t in [*module.parameters(), *module.buffers()]}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in weights:  # a saved weight costs no memory of its own
            seen[(storage.data_ptr(), storage.nbytes())] = storage.nbytes()
        return t

    partition = f"memory_{step}"
    req = side.modality.request(side.data_source.next_batch(int(side.cfg.prompts_per_rollout)), step)
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


def _status_mb(key: str) -> float:
    """A kB field of /proc/self/status (VmRSS, VmHWM), in MiB."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(key + ":")) / 1024


def run_memory_side(args: argparse.Namespace) -> int:
    """Child of `--memory`: build one side, run a warm-up step, reset the peak-RSS mark (Linux:
    5 into /proc/self/clear_refs), run `--memory-steps` steps; print the RSS before the steps
    and the peak during them."""
    quiet_library_logs()
    side = Side(
        args.memory_side, compose_side(args.recipe, args.overrides, args.memory_side), 1 + args.memory_steps
    )
    side.step(0)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = _status_mb("VmRSS")
    for step in range(1, 1 + args.memory_steps):
        side.step(step)
    peak = _status_mb("VmHWM")
    side.close()
    print(json.dumps({"rss_before_steps_mb": round(before, 1), "peak_rss_mb": round(peak, 1)}))
    return 0


def memory_of(side: str, args: argparse.Namespace) -> dict[str, float]:
    """`run_memory_side`'s figures for `side`, from a subprocess."""
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
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def ratios(rows: dict[str, list[dict[str, float]]], key: str) -> dict[str, float]:
    """keep_graph / replay of `key`: median of the step pairs' ratios, of the medians, of the minima."""
    keep, replay = [r[key] for r in rows["keep_graph"]], [r[key] for r in rows["replay"]]
    return {
        "median_of_pairs": round(statistics.median(k / r for k, r in zip(keep, replay, strict=True)), 3),
        "of_medians": round(statistics.median(keep) / statistics.median(replay), 3),
        "of_minima": round(min(keep) / min(replay), 3),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default="diffusion/tiny_sd3_flowgrpo")
    parser.add_argument("--steps", type=int, default=12, help="steps per side, warm-up included")
    parser.add_argument("--warmup", type=int, default=2, help="first steps dropped")
    parser.add_argument("--memory", action="store_true", help="also measure each side's RSS apart")
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
    load = [os.getloadavg()[0]]
    for step in range(args.steps):
        for name in SIDES if step % 2 == 0 else SIDES[::-1]:
            per_step[name].append(sides[name].step(step))
    load.append(os.getloadavg()[0])
    memory = saved_bytes_per_pair(sides["keep_graph"], args.steps)
    for side in sides.values():
        side.close()
    timed = {name: rows[args.warmup :] for name, rows in per_step.items()}
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
        row: dict[str, Any] = {**common, "phase": phase}
        for unit, key in (("s", phase), ("cpu_s", f"{phase}_cpu")):
            for name in SIDES:
                values = [r[key] for r in timed[name]]
                row[f"{name}_median_{unit}"] = round(statistics.median(values), 4)
                row[f"{name}_per_step_{unit}"] = [round(v, 4) for v in values]
            row[f"ratio_{unit}"] = ratios(timed, key)
        lines.append(row)
    step_ratio = ratios(timed, "step")["median_of_pairs"]
    summary: dict[str, Any] = {
        **common,
        "phase": "summary",
        "step_ratio": step_ratio,
        "step_cpu_ratio": ratios(timed, "step_cpu")["median_of_pairs"],
        "goal": GOAL,
        "goal_met": step_ratio <= GOAL,
        "load_average_1min_start_end": load,
        "kept_fraction": statistics.mean(r["kept_fraction"] for r in timed["keep_graph"]),
        **{f"loss_{name}": [round(r["loss"], 6) for r in per_step[name]] for name in SIDES},
        **{f"reward_{name}": [round(r["reward_mean"], 4) for r in per_step[name]] for name in SIDES},
        **memory,
    }
    if args.memory:
        summary["memory"] = {name: memory_of(name, args) for name in SIDES}
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
