"""Weight-sync time and throughput per backend vs memcpy, and sync time as a fraction of a step.

One run measures, side by side:

1. **step time**: the tiny recipe (`examples/diffusion/tiny_sd3_flowgrpo.yaml`,
   1 worker) for `--steps` steps; the median `time/step_s` after the first.
2. **payloads**: `sd3_lora` / `sd3_full` are the tiny recipe's transformer
   (its LoRA: rank 8 on its 9 target modules; or every weight), `large_lora` /
   `large_full` a random SD3 transformer of 251 MB in fp32 (12 blocks, width 384;
   LoRA rank 16 on the same targets).
3. per payload and wire dtype (the weights' own, fp32, or `bfloat16`):
   - **memcpy** (the reference), in the receiving actor with one torch thread:
     `clone()` of every tensor (fresh memory) and `copy_()` into the engine's
     own parameters (preallocated, touched: what a sync writes into);
   - **each backend**: a sender actor (the trainer) syncs into a receiver
     actor's module (the engine, bound with `bind`), one torch thread each,
     verify off and then on. The time is the driver's wall time of one
     sync (send + receive, Ray calls included); `send_s` / `receive_s` are
     the two sides' own times. Median of `--repeats` after one warm-up sync.

GB/s = payload bytes in the weights' dtype / seconds (1 GB = 1e9 B), so a
bf16 wire moves half the bytes for the same payload. `fraction_of_step` =
sync seconds / the tiny recipe's step seconds.

Output: JSON lines on stdout and appended to `--out`; a Markdown table on stderr.

    python benchmarks/weight_sync.py [--steps 6] [--repeats 5] [--payloads ...] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["RAY_ADDRESS"] = "local"  # a private Ray instance, never another user's cluster
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # everything binds to loopback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import ray  # noqa: E402
import torch  # noqa: E402

from unirl.sync import SyncPlan, WeightSyncConfig, bind, make_receiver, make_sender, plan_for, select  # noqa: E402
from unirl.trainer.trainer import WORKER_ENV  # noqa: E402

RECIPE = "diffusion/tiny_sd3_flowgrpo"
LORA_TARGETS = [
    "to_q",
    "to_k",
    "to_v",
    "to_out.0",
    "add_q_proj",
    "add_k_proj",
    "add_v_proj",
    "to_add_out",
    "proj_out",
]
# name -> (TinySD3Config overrides, LoRA rank or None for a full payload)
PAYLOADS: dict[str, tuple[dict, int | None]] = {
    "sd3_lora": (dict(num_layers=2, attention_head_dim=32, num_attention_heads=4), 8),
    "sd3_full": (dict(num_layers=2, attention_head_dim=32, num_attention_heads=4), None),
    "large_lora": (dict(num_layers=12, attention_head_dim=64, num_attention_heads=6), 16),
    "large_full": (dict(num_layers=12, attention_head_dim=64, num_attention_heads=6), None),
}
BACKENDS = ["object_store", "broadcast"]


def build(payload: str) -> torch.nn.Module:
    """The payload's transformer (pixel space, 32 px, patch 4: the tiny recipe's geometry)."""
    from peft import LoraConfig

    from unirl.models.sd3.bundle import SD3Bundle, TinySD3Config

    arch, rank = PAYLOADS[payload]
    module = SD3Bundle.tiny_transformer(TinySD3Config(resolution=32, patch_size=4, **arch))
    if rank is not None:
        module.add_adapter(LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=LORA_TARGETS))
    return module


class Side:
    """One side of the sync (a Ray actor with one torch thread): the trainer or the engine."""

    def __init__(self) -> None:
        torch.set_num_threads(1)
        self.sender = self.receiver = None

    def build(self, payload: str) -> None:
        self.module, self.kind = build(payload), "full" if PAYLOADS[payload][1] is None else "lora"

    def plan(self, cfg: dict) -> SyncPlan:
        return plan_for(self.module, self.kind, WeightSyncConfig(**cfg))

    def make_sender(self, cfg: dict, plan: SyncPlan) -> Any:
        self.sender = make_sender(WeightSyncConfig(**cfg), plan)
        return self.sender.endpoint()

    def make_receiver(self, cfg: dict, plan: SyncPlan, endpoint: Any) -> None:
        self.receiver = make_receiver(WeightSyncConfig(**cfg), plan, endpoint)
        self.into = bind(self.module, plan)

    def connect(self) -> None:
        (self.sender or self.receiver).connect()

    def send(self, version: int) -> Any:
        ticket = self.sender.send(self.module.named_parameters(), version)
        return ticket, self.sender.stats

    def receive(self, ticket: Any) -> dict[str, float]:
        self.receiver.receive(ticket, into=self.into)
        return self.receiver.stats

    def close(self) -> None:
        for side in (self.sender, self.receiver):
            if side is not None:
                side.close()
        self.sender = self.receiver = None

    def memcpy(self, repeats: int) -> dict[str, float]:
        """Median seconds to clone the payload's tensors, and to copy them into the module's own."""
        dests = list(select(self.module.named_parameters(), self.kind).values())
        with torch.no_grad():
            sources = [d.detach().clone() for d in dests]
            clone, copy = [], []
            for _ in range(repeats + 1):
                start = time.perf_counter()
                fresh = [s.clone() for s in sources]
                clone.append(time.perf_counter() - start)
                del fresh
                start = time.perf_counter()
                for d, s in zip(dests, sources, strict=True):
                    d.copy_(s)
                copy.append(time.perf_counter() - start)
        return {"clone_s": statistics.median(clone[1:]), "copy_s": statistics.median(copy[1:])}


def recipe_step_s(steps: int) -> float:
    """Median `time/step_s` of the tiny recipe (1 worker) after the first step."""
    from hydra import compose, initialize_config_dir

    from unirl.config.validate import validate_recipe
    from unirl.trainer.trainer import Trainer

    with tempfile.TemporaryDirectory() as out:
        with initialize_config_dir(config_dir=os.path.join(REPO, "examples"), version_base=None):
            cfg = compose(
                RECIPE,
                overrides=[
                    f"num_steps={steps}",
                    f"output_dir={out}",
                    "logging.progress=false",
                    "logging.save_images_every=0",
                ],
            )
        validate_recipe(cfg)
        rows = Trainer(cfg).run()
    ray.shutdown()  # the trainer joined the private instance RAY_ADDRESS names and leaves it up
    return statistics.median(r["time/step_s"] for r in rows[1:])


def sync_times(trainer: Any, engine: Any, cfg: dict, repeats: int) -> dict[str, Any]:
    """Connect a sender and a receiver of `cfg`, run 1 + `repeats` syncs, close; medians."""
    plan = ray.get(trainer.plan.remote(cfg))
    endpoint = ray.get(trainer.make_sender.remote(cfg, plan))
    ray.get(engine.make_receiver.remote(cfg, plan, endpoint))
    ray.get([trainer.connect.remote(), engine.connect.remote()])
    walls, sends, receives = [], [], []
    for version in range(repeats + 1):
        start = time.perf_counter()
        if cfg["backend"] == "broadcast":
            (_, sent), received = ray.get([trainer.send.remote(version), engine.receive.remote(None)])
        else:
            ticket, sent = ray.get(trainer.send.remote(version))
            received = ray.get(engine.receive.remote(ticket))
        walls.append(time.perf_counter() - start)
        sends.append(sent["sync/send_s"])
        receives.append(received["sync/receive_s"])
    ray.get([trainer.close.remote(), engine.close.remote()])
    return {
        "bytes": plan.nbytes,
        "wire_bytes": plan.wire_nbytes,
        "buckets": len(plan.buckets),
        "tensors": len(plan.tensors),
        "sync_s": statistics.median(walls[1:]),
        "sync_min_s": min(walls[1:]),
        "send_s": statistics.median(sends[1:]),
        "receive_s": statistics.median(receives[1:]),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=6, help="tiny-recipe steps for the step time (0: skip)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--payloads", nargs="+", default=list(PAYLOADS), choices=list(PAYLOADS))
    ap.add_argument("--backends", nargs="+", default=BACKENDS, choices=BACKENDS)
    ap.add_argument("--bucket-mb", type=float, default=WeightSyncConfig(backend="broadcast").bucket_mb)
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "weight_sync.jsonl"))
    args = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    out = open(args.out, "a")
    meta = {
        "bench": "weight_sync",
        "torch": torch.__version__,
        "threads_per_side": 1,
        "repeats": args.repeats,
    }

    def emit(row: dict) -> None:
        line = json.dumps({**meta, **row, "load_1min": round(os.getloadavg()[0], 2)})
        print(line, flush=True)
        out.write(line + "\n")
        out.flush()

    step_s = recipe_step_s(args.steps) if args.steps else None  # before our own Ray instance
    if step_s is not None:
        emit({"kind": "step_time", "recipe": RECIPE, "steps": args.steps, "step_s": step_s})
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": WORKER_ENV})
    actor = ray.remote(num_cpus=1)(Side)
    trainer, engine = actor.remote(), actor.remote()
    table = []
    for payload in args.payloads:
        ray.get([trainer.build.remote(payload), engine.build.remote(payload)])
        copy = ray.get(engine.memcpy.remote(args.repeats))
        mem = None
        for wire in (None, "bfloat16"):
            for backend in args.backends:
                for verify in (False, True):
                    cfg = {
                        "backend": backend,
                        "bucket_mb": args.bucket_mb,
                        "wire_dtype": wire,
                        "verify": verify,
                    }
                    row = sync_times(trainer, engine, cfg, args.repeats)
                    if mem is None:
                        mem = {
                            "kind": "memcpy",
                            "payload": payload,
                            "bytes": row["bytes"],
                            **copy,
                            "clone_gbps": row["bytes"] / copy["clone_s"] / 1e9,
                            "copy_gbps": row["bytes"] / copy["copy_s"] / 1e9,
                        }
                        emit(mem)
                    row = {
                        "kind": "sync",
                        "payload": payload,
                        "backend": backend,
                        "wire_dtype": wire or "native",
                        "verify": verify,
                        "bucket_mb": args.bucket_mb,
                        **row,
                        "gbps": row["bytes"] / row["sync_s"] / 1e9,
                        "vs_copy": copy["copy_s"] / row["sync_s"],
                        "fraction_of_step": row["sync_s"] / step_s if step_s else None,
                    }
                    emit(row)
                    table.append((mem, row))
    ray.shutdown()
    out.close()
    print(
        "\n| payload | MB | backend | wire | verify | sync ms | GB/s | send / receive ms | "
        "clone / copy_ GB/s | sync / copy_ | of step |\n|---|---:|---|---|---|---:|---:|---:|---:|---:|---:|",
        file=sys.stderr,
    )
    for mem, row in table:
        frac = f"{100 * row['fraction_of_step']:.2f}%" if row["fraction_of_step"] is not None else "-"
        print(
            f"| {row['payload']} | {row['bytes'] / 1e6:.2f} | {row['backend']} | {row['wire_dtype']} | "
            f"{'on' if row['verify'] else 'off'} | {1e3 * row['sync_s']:.1f} | {row['gbps']:.2f} | "
            f"{1e3 * row['send_s']:.1f} / {1e3 * row['receive_s']:.1f} | "
            f"{mem['clone_gbps']:.2f} / {mem['copy_gbps']:.2f} | {row['vs_copy']:.3f} | {frac} |",
            file=sys.stderr,
        )


if __name__ == "__main__":
    main()
