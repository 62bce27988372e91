"""Reward-service throughput and latency: remote (the reward server) vs in-process scoring.

The same scorer, side by side in one run, under 1, 4 and 16 concurrent clients
(`--clients`), three ways:

- **local**: a `LocalRewardBackend` in this process; each client is a thread
  calling `backend.score(req)` (what a driver does in-process).
- **remote**: `python -m unirl.reward.server` in a subprocess (merging
  concurrent requests up to `--max-batch` samples, the server's default 64);
  each client thread scores through
  its own `RemoteRewardBackend` (raw images, or PNG with `--image-encoding png`;
  JSON over loopback HTTP, kept-alive connections, a bearer token).
- **remote_nomerge**: the same server with `--max-batch 1` (every request its
  own scorer call): what the server's batching is worth.

Scorers (`--scorers`):

- `color`: the tiny diffusion recipe's reward (`examples/diffusion/tiny_sd3_flowgrpo.yaml`,
  `ColorTarget`), 32 RGB images of 32x32 per request (one rollout of the recipe).
- `text`: the tiny LM recipe's reward (`examples/llm/tiny_lm_grpo.yaml`,
  `TargetCharFraction`), 64 texts of ~16 characters per request.
- `mlp`: a learned-reward-model stand-in whose per-sample cost falls with the batch
  (`MLPRewardModel` below: 4x4 average pool, 8 linear layers of width 256, random
  weights, 0.6M parameters; ~136 us per sample alone, ~25 us in a batch of 64 on
  one core here), 4 images of 64x64 per request: many clients sending small
  requests, the case merging is for.
- `conv`: a small conv net (`ConvRewardModel`, 56k parameters), 16 images of 64x64
  per request; on this machine's CPU its per-sample cost *rises* with the batch
  (~1 ms at 16, ~1.3 ms at 64), so merging costs it compute.

Within each of `--rounds` rounds the three modes alternate per client count, each
going first in turn (so they share the machine's load); each client sends requests back to back for
`--seconds` after 2 warm-up requests. Latency is per request as the client sees
it (encoding included); throughput = samples scored by all clients / wall time.
Torch runs 1 thread on both sides (`OMP_NUM_THREADS=1` in the server). Prints a
table of medians over the rounds and writes JSON lines (appended to `--out`):
one per (scorer, mode, clients) with `samples_per_s`, `p50_ms`, `p95_ms`, for the
server `samples_per_scorer_call` and `server_cpu_ms_per_sample` (the server
process's CPU time per sample, less sensitive to a busy machine than wall time),
and `load_1min` (medians, and each round's in
`*_per_round`), `best_samples_per_s` / `best_p50_ms` (the least disturbed round); one `summary` line per scorer with the throughput ratios
remote / local and remote / remote_nomerge (of the medians, and `best_*` of the
best rounds), and the server CPU per sample remote / remote_nomerge, per client
count. With one client nothing can merge: its remote / remote_nomerge ratio is
the noise floor of the run. A `scorer_only` line per client count > 1 times the
scorer alone in-process, the clients' requests one call each vs merged as the
server merges them (fastest of 15): what merging saves inside the scorer.

    python benchmarks/reward_service.py [--seconds 1.5] [--rounds 5] [--clients 1 4 16] [--scorers color text mlp conv]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import torch

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:  # the model scorers are imported as benchmarks.reward_service.*
    sys.path.insert(0, REPO)

from unirl.reward import LocalRewardBackend, RemoteRewardBackend  # noqa: E402
from unirl.reward.batching import merge_requests  # noqa: E402
from unirl.reward.server import ServerConfig, load_backend  # noqa: E402
from unirl.types.reward import RewardRequest  # noqa: E402

RESULTS = os.path.join(REPO, "benchmarks", "results", "reward_service.jsonl")
TOKEN = "benchmark-token"


class MLPRewardModel:
    """Scorer: 4x4 average pool of a 64x64 image in [0, 1], 8 linear layers (GELU) -> [B] fp32.

    Random weights from `seed`; a stand-in for a reward model whose cost per call
    is dominated by per-layer overhead at small batches (as on a GPU).
    """

    def __init__(self, width: int = 256, depth: int = 8, seed: int = 0) -> None:
        torch.manual_seed(seed)
        layers: list[torch.nn.Module] = [torch.nn.Linear(3 * 16 * 16, width), torch.nn.GELU()]
        for _ in range(depth - 2):
            layers += [torch.nn.Linear(width, width), torch.nn.GELU()]
        self.net = torch.nn.Sequential(*layers, torch.nn.Linear(width, 1)).eval()

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        images = req.require_images("MLPRewardModel").to(torch.float32) / 255.0
        with torch.no_grad():
            return self.net(torch.nn.functional.avg_pool2d(images, 4).flatten(1))[:, 0]


class ConvRewardModel:
    """Scorer: a random 3-layer conv net + linear head on the image in [0, 1] -> [B] fp32.

    Weights come from `seed`; a stand-in for a learned reward model (its cost per
    sample falls with the batch).
    """

    def __init__(self, width: int = 32, seed: int = 0) -> None:
        torch.manual_seed(seed)
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, width, 3, stride=2, padding=1),
            torch.nn.GELU(),
            torch.nn.Conv2d(width, 2 * width, 3, stride=2, padding=1),
            torch.nn.GELU(),
            torch.nn.Conv2d(2 * width, 2 * width, 3, stride=2, padding=1),
            torch.nn.GELU(),
            torch.nn.AdaptiveAvgPool2d(1),
            torch.nn.Flatten(),
            torch.nn.Linear(2 * width, 1),
        ).eval()

    def __call__(self, req: RewardRequest) -> torch.Tensor:
        images = req.require_images("ConvRewardModel").to(torch.float32) / 255.0
        with torch.no_grad():
            return self.net(images)[:, 0]


def server_config(scorer: str, tmp: str) -> str:
    if scorer == "color":
        return os.path.join(REPO, "examples", "diffusion", "tiny_sd3_flowgrpo.yaml")
    if scorer == "text":
        return os.path.join(REPO, "examples", "llm", "tiny_lm_grpo.yaml")
    target = {"mlp": "MLPRewardModel", "conv": "ConvRewardModel"}[scorer]
    path = os.path.join(tmp, f"{scorer}_reward.yaml")
    with open(path, "w") as f:
        f.write(f"components:\n  {scorer}: {{_target_: benchmarks.reward_service.{target}}}\n")
    return path


def make_requests(scorer: str, clients: int) -> list[RewardRequest]:
    """One request per client, different content, the batch of one rollout of the scorer's recipe."""
    out = []
    for c in range(clients):
        g = torch.Generator().manual_seed(c)
        if scorer == "text":
            n = 64
            chars = "abcdefghij0123456789 "
            texts = [
                "".join(chars[int(i)] for i in torch.randint(0, len(chars), (16,), generator=g))
                for _ in range(n)
            ]
            out.append(
                RewardRequest([f"c{c}-{i}" for i in range(n)], ["p"] * n, texts=texts, metadata=[{}] * n)
            )
            continue
        n, size = {"color": (32, 32), "mlp": (4, 64), "conv": (16, 64)}[scorer]
        images = torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=g)
        out.append(
            RewardRequest([f"c{c}-{i}" for i in range(n)], ["p"] * n, images=images, metadata=[{}] * n)
        )
    return out


def drive(backends: list, reqs: list[RewardRequest], seconds: float) -> dict:
    """Every client scores its request back to back for `seconds` (after 2 warm-ups)."""
    barrier = threading.Barrier(len(backends) + 1)
    latencies: list[list[float]] = [[] for _ in backends]
    samples = [0] * len(backends)
    deadline, go = [0.0], threading.Event()

    def client(i: int) -> None:
        for _ in range(2):
            backends[i].score(reqs[i])
        barrier.wait()
        go.wait()
        while time.perf_counter() < deadline[0]:
            t0 = time.perf_counter()
            backends[i].score(reqs[i])
            latencies[i].append(time.perf_counter() - t0)
            samples[i] += len(reqs[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(backends))]
    for t in threads:
        t.start()
    barrier.wait()  # every client warmed up
    start = time.perf_counter()
    deadline[0] = start + seconds
    go.set()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    lat = sorted(x for per in latencies for x in per)
    return {
        "samples_per_s": sum(samples) / wall,
        "p50_ms": 1000 * statistics.median(lat),
        "p95_ms": 1000 * lat[min(len(lat) - 1, int(0.95 * len(lat)))],
        "requests": len(lat),
        "wall_s": wall,
    }


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of process `pid` (Linux /proc), None elsewhere."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def health(url: str) -> dict:
    with urllib.request.urlopen(url + "/health", timeout=30) as answer:
        return json.loads(answer.read())


def start_server(config: str, max_batch: int, token_file: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "unirl.reward.server", "--config", config, "--port", "0"]
        + ["--token-file", token_file, "--max-batch", str(max_batch)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
    )
    line = proc.stdout.readline()
    if " on http" not in line:
        proc.kill()
        raise RuntimeError(f"the reward server did not start: {line!r}")
    return proc, line.strip().rsplit(" on ", 1)[1]


MODES = ("local", "remote", "remote_nomerge")
SCORERS = ("color", "text", "mlp", "conv")


def scorer_only(scorer: str, local: LocalRewardBackend, clients: int, max_batch: int, reps: int = 15) -> dict:
    """What merging saves inside the scorer: `clients` requests scored one call each vs merged
    as the server merges them (consecutive requests up to `max_batch` samples per call),
    in-process, no HTTP; the fastest of `reps` alternating repetitions."""
    reqs = make_requests(scorer, clients)
    groups: list[list[RewardRequest]] = []
    for req in reqs:
        if groups and sum(len(r) for r in groups[-1]) + len(req) <= max_batch:
            groups[-1].append(req)
        else:
            groups.append([req])
    merged = [merge_requests(g) for g in groups]
    separate_s, merged_s = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for req in reqs:
            local.score(req)
        separate_s.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for req in merged:
            local.score(req)
        merged_s.append(time.perf_counter() - t0)
    return {
        "scorer": scorer,
        "mode": "scorer_only",
        "clients": clients,
        "merged_calls": len(merged),
        "separate_ms": 1000 * min(separate_s),
        "merged_ms": 1000 * min(merged_s),
        "merged_over_separate": min(merged_s) / min(separate_s),
    }


def measure(scorer: str, mode: str, clients: int, target, args, pid: int | None = None) -> dict:
    """One (scorer, mode, clients) cell: `target` is the local backend or the server's URL
    (`pid` its process, whose CPU time per sample is recorded)."""
    reqs = make_requests(scorer, clients)
    if isinstance(target, str):
        backends = [
            RemoteRewardBackend(
                target,
                token_env="UNIRL_BENCH_REWARD_TOKEN",
                timeout_s=120,
                image_encoding=args.image_encoding,
            )
            for _ in range(clients)
        ]
        before, cpu_before = health(target), cpu_seconds(pid)
    else:
        backends = [target] * clients
    row = {"scorer": scorer, "mode": mode, "clients": clients, **drive(backends, reqs, args.seconds)}
    row["samples_per_request"] = len(reqs[0])
    row["load_1min"] = os.getloadavg()[0]
    if isinstance(target, str):
        after = health(target)
        calls = max(after["scorer_calls"] - before["scorer_calls"], 1)
        samples = after["samples"] - before["samples"]
        row["samples_per_scorer_call"] = samples / calls
        cpu_after = cpu_seconds(pid)
        if cpu_before is not None and cpu_after is not None:
            row["server_cpu_ms_per_sample"] = 1000 * (cpu_after - cpu_before) / max(samples, 1)
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=1.5, help="per cell and round")
    parser.add_argument("--rounds", type=int, default=5, help="the modes alternate within each round")
    parser.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--scorers", nargs="+", default=list(SCORERS), choices=list(SCORERS))
    parser.add_argument("--image-encoding", default="raw", choices=["raw", "png"])
    parser.add_argument(
        "--max-batch", type=int, default=ServerConfig().max_batch, help="the merging server's"
    )
    parser.add_argument("--out", default=RESULTS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    meta = {
        "torch": torch.__version__,
        "threads": 1,
        "cpus": os.cpu_count(),
        "seconds": args.seconds,
        "rounds": args.rounds,
        "image_encoding": args.image_encoding,
        "max_batch": args.max_batch,
    }
    lines = []
    with tempfile.TemporaryDirectory() as tmp:
        token_file = os.path.join(tmp, "token")
        with open(token_file, "w") as f:
            f.write(TOKEN)
        os.environ["UNIRL_BENCH_REWARD_TOKEN"] = TOKEN
        for scorer in args.scorers:
            config = server_config(scorer, tmp)
            local = load_backend(config)
            assert isinstance(local, LocalRewardBackend)
            servers = {
                "remote": start_server(config, args.max_batch, token_file),
                "remote_nomerge": start_server(config, 1, token_file),
            }
            targets = {"local": local, **{m: url for m, (_, url) in servers.items()}}
            pids = {m: proc.pid for m, (proc, _) in servers.items()}
            cells: dict[tuple[str, int], list[dict]] = {}
            try:
                for r in range(args.rounds):
                    for clients in args.clients:
                        for mode in MODES[r % 3 :] + MODES[: r % 3]:  # each mode goes first in turn
                            cells.setdefault((mode, clients), []).append(
                                measure(scorer, mode, clients, targets[mode], args, pids.get(mode))
                            )
            finally:
                for proc, _ in servers.values():
                    proc.terminate()
                    proc.wait(timeout=30)
            for clients in args.clients:
                if clients > 1:
                    lines.append({**scorer_only(scorer, local, clients, args.max_batch), **meta})
                    print(json.dumps(lines[-1]), flush=True)
            summary = {"scorer": scorer, "mode": "summary", **meta}
            for clients in args.clients:
                for mode in MODES:
                    runs = cells[(mode, clients)]
                    row = {"scorer": scorer, "mode": mode, "clients": clients, **meta}
                    for key in (
                        "samples_per_s",
                        "p50_ms",
                        "p95_ms",
                        "samples_per_scorer_call",
                        "server_cpu_ms_per_sample",
                        "load_1min",
                    ):
                        if key in runs[0]:
                            row[key] = statistics.median(r[key] for r in runs)
                            row[f"{key}_per_round"] = [r[key] for r in runs]
                    row["best_samples_per_s"] = max(row["samples_per_s_per_round"])
                    row["best_p50_ms"] = min(row["p50_ms_per_round"])
                    row["samples_per_request"] = runs[0]["samples_per_request"]
                    lines.append(row)
                    print(json.dumps(row), flush=True)
                last = dict(zip(MODES, lines[-3:], strict=True))
                thr = {m: row["samples_per_s"] for m, row in last.items()}
                best = {m: row["best_samples_per_s"] for m, row in last.items()}
                summary[f"remote_over_local_{clients}"] = thr["remote"] / thr["local"]
                summary[f"merge_over_nomerge_{clients}"] = thr["remote"] / thr["remote_nomerge"]
                summary[f"best_remote_over_local_{clients}"] = best["remote"] / best["local"]
                summary[f"best_merge_over_nomerge_{clients}"] = best["remote"] / best["remote_nomerge"]
                cpu = {m: last[m].get("server_cpu_ms_per_sample") for m in ("remote", "remote_nomerge")}
                if None not in cpu.values():
                    summary[f"server_cpu_merge_over_nomerge_{clients}"] = (
                        cpu["remote"] / cpu["remote_nomerge"]
                    )
            lines.append(summary)
            print(json.dumps(summary), flush=True)
    with open(args.out, "a") as f:
        for row in lines:
            f.write(json.dumps(row) + "\n")
    print(f"\nmedians over {args.rounds} round(s) of {args.seconds:g} s per cell")
    print(
        f"{'scorer':7} {'mode':15} {'clients':>7} {'samples/s':>10} {'best':>8} {'p50 ms':>8} {'p95 ms':>8} "
        f"{'per call':>8} {'srv cpu ms/sample':>17}"
    )
    for row in lines:
        if row["mode"] == "scorer_only":
            print(
                f"{row['scorer']:7} scorer only, {row['clients']} requests: {row['separate_ms']:.2f} ms one call "
                f"each, {row['merged_ms']:.2f} ms in {row['merged_calls']} merged call(s) "
                f"({row['merged_over_separate']:.2f}x)"
            )
        if row["mode"] in ("summary", "scorer_only"):
            continue
        per_call, cpu = row.get("samples_per_scorer_call"), row.get("server_cpu_ms_per_sample")
        print(
            f"{row['scorer']:7} {row['mode']:15} {row['clients']:>7} {row['samples_per_s']:>10.0f} "
            f"{row['best_samples_per_s']:>8.0f} "
            f"{row['p50_ms']:>8.2f} {row['p95_ms']:>8.2f} {'' if per_call is None else f'{per_call:.1f}':>8} "
            f"{'' if cpu is None else f'{cpu:.3f}':>17}"
        )


if __name__ == "__main__":
    main()
