"""Data-plane throughput per transport vs memcpy, and the tiny recipe's step time per transport.

One run measures, side by side:

1. **memcpy**: `dst.copy_(src)` of the payload into a preallocated, touched
   buffer in this process, with 1 torch thread (what a consumer worker uses
   on 2 cores; the summary's reference) and with all threads.
2. **put / get per transport** (`inband`, `ray`, `tq_simple`, `tq_mooncake`)
   for dense fp32 payloads of 1, 16, 128 and 512 MiB (8 samples): a producer
   actor builds the batch and puts it into a partition; the driver receives
   the meta; a consumer actor gets every field by meta. `put` is the driver's
   wall time from the call to holding the meta, minus the producer's time to
   build the payload; `get` is the driver's wall time of the consumer's get
   call (which returns only a checksum). Both therefore include what the
   driver carries: for `inband` the data itself rides in the meta through
   Ray. `get_in_consumer` is the transport's get alone, timed in the
   consumer. Median of `--repeats`; GB/s = payload bytes / seconds (1 GB =
   1e9 B). The summary compares the best end-to-end get at the largest
   payload with the 1-thread memcpy.
3. **step time**: the tiny recipe (`examples/diffusion/tiny_sd3_flowgrpo.yaml`,
   2 workers) for `--steps` steps per transport; the median `time/step_s`
   after the first (warm-up) step and its ratio to `inband`.

Output: JSON lines on stdout and appended to `--out`.

    python benchmarks/dataplane.py [--sizes 1 16 128 512] [--repeats 3] [--steps 6] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ["RAY_ADDRESS"] = "local"  # a private Ray instance, never another user's cluster
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # everything binds to loopback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import ray  # noqa: E402
import torch  # noqa: E402

from unirl.dataplane import TRANSPORTS, make_transport  # noqa: E402
from unirl.trainer.trainer import WORKER_ENV  # noqa: E402

MiB = 1 << 20
NUM_SAMPLES = 8


def transport_cfg(name: str, largest_mib: int) -> dict:
    from omegaconf import OmegaConf

    cfg = OmegaConf.to_container(OmegaConf.load(os.path.join(REPO, "examples", "transport", f"{name}.yaml")))
    if name == "tq_mooncake":  # the producer's segment holds the whole payload
        cfg["global_segment_size"] = max(cfg["global_segment_size"], 2 * largest_mib * MiB)
        cfg["local_buffer_size"] = max(cfg["local_buffer_size"], largest_mib * MiB + 64 * MiB)
    return cfg


@ray.remote(num_cpus=0.1, runtime_env={"env_vars": WORKER_ENV})  # the environment trainer workers get
class Peer:
    def __init__(self, cfg: dict, info: dict) -> None:
        torch.set_num_threads(1)
        self.transport = make_transport(cfg)
        self.transport.attach(info)

    def put(self, partition: str, nbytes: int):
        t0 = time.perf_counter()
        x = torch.ones(NUM_SAMPLES, nbytes // 4 // NUM_SAMPLES)
        build_s = time.perf_counter() - t0
        return self.transport.put(
            partition, [f"{partition}_{i}" for i in range(NUM_SAMPLES)], {"x": x}
        ), build_s

    def get(self, meta) -> tuple[float, float]:
        """(checksum, seconds of the transport's get in this process)."""
        t0 = time.perf_counter()
        x = self.transport.get(meta)["x"]
        return float(x[:, :4].sum()), time.perf_counter() - t0

    def close(self) -> None:
        self.transport.close()


def memcpy_gbps(nbytes: int, repeats: int, threads: int) -> float:
    """Bandwidth of `dst.copy_(src)` into a preallocated, already touched buffer with `threads` torch threads."""
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return _memcpy_gbps(nbytes, repeats)
    finally:
        torch.set_num_threads(before)


def _memcpy_gbps(nbytes: int, repeats: int) -> float:
    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    dst.copy_(src)  # touch the pages
    times = []
    for _ in range(max(repeats, 10)):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return nbytes / statistics.median(times) / 1e9


def throughput(name: str, sizes: list[int], repeats: int, emit) -> None:
    cfg = transport_cfg(name, max(sizes))
    driver = make_transport(cfg)
    info = driver.start()
    producer, consumer = Peer.remote(cfg, info), Peer.remote(cfg, info)
    try:
        for size in sizes:
            nbytes = size * MiB
            put_s, get_s, op_s = [], [], []
            for r in range(repeats + 1):  # the first round is a warm-up
                part = f"bench_{size}_{r}"
                try:
                    t0 = time.perf_counter()
                    meta, build_s = ray.get(producer.put.remote(part, nbytes))
                    t1 = time.perf_counter()
                    checksum, get_op_s = ray.get(consumer.get.remote(meta))
                    t2 = time.perf_counter()
                finally:
                    driver.clear(part)
                    meta = None
                assert checksum == NUM_SAMPLES * 4, checksum
                if r:
                    put_s.append(t1 - t0 - build_s)
                    get_s.append(t2 - t1)
                    op_s.append(get_op_s)
            emit(
                {
                    "kind": "throughput",
                    "transport": name,
                    "payload_mib": size,
                    "put_s": statistics.median(put_s),
                    "get_s": statistics.median(get_s),
                    "put_gbps": nbytes / statistics.median(put_s) / 1e9,
                    "get_gbps": nbytes / statistics.median(get_s) / 1e9,
                    "get_in_consumer_gbps": nbytes / statistics.median(op_s) / 1e9,
                }
            )
    finally:
        ray.get([producer.close.remote(), consumer.close.remote()])
        ray.kill(producer)
        ray.kill(consumer)
        driver.close()


def step_times(names: list[str], steps: int, emit) -> None:
    from hydra import compose, initialize_config_dir

    from unirl.config.validate import validate_recipe
    from unirl.trainer.trainer import Trainer

    medians = {}
    for name in names:
        with tempfile.TemporaryDirectory() as out:
            with initialize_config_dir(config_dir=os.path.join(REPO, "examples"), version_base=None):
                cfg = compose(
                    "diffusion/tiny_sd3_flowgrpo",
                    overrides=[
                        f"transport={name}",
                        "num_devices=2",
                        f"num_steps={steps}",
                        f"output_dir={out}",
                        "logging.progress=false",
                        "logging.save_images_every=0",
                    ],
                )
            validate_recipe(cfg)
            rows = Trainer(cfg).run()
        step = statistics.median(r["time/step_s"] for r in rows[1:])
        dp = statistics.median(
            sum(v for k, v in r.items() if k.startswith("dataplane/") and k.endswith("_s")) for r in rows[1:]
        )
        medians[name] = step
        emit(
            {
                "kind": "step_time",
                "transport": name,
                "num_devices": 2,
                "steps": steps,
                "step_s": step,
                "dataplane_op_s": dp,
                "ratio_to_inband": step / medians["inband"] if "inband" in medians else None,
            }
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes", type=int, nargs="*", default=[1, 16, 128, 512], help="payloads in MiB (none: skip)"
    )
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--steps", type=int, default=6, help="tiny-recipe steps per transport (0: skip)")
    ap.add_argument("--transports", nargs="+", default=list(TRANSPORTS))
    ap.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "dataplane.jsonl"))
    args = ap.parse_args()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    out = open(args.out, "a")

    def emit(row: dict) -> None:
        line = json.dumps(row)
        print(line, flush=True)
        out.write(line + "\n")
        out.flush()

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        if args.sizes:
            throughput_table(args, emit)
        if args.steps:
            step_times(["inband"] + [n for n in args.transports if n != "inband"], args.steps, emit)
    finally:
        ray.shutdown()
        out.close()


def throughput_table(args: argparse.Namespace, emit) -> None:
    for size in args.sizes:
        for threads in (1, torch.get_num_threads()):
            emit({"kind": "throughput", "transport": "memcpy", "threads": threads, "payload_mib": size,
                  "get_gbps": memcpy_gbps(size * MiB, args.repeats, threads)})  # fmt: skip
    best = {}
    for name in args.transports:
        rows: list[dict] = []

        def keep(row: dict, rows: list[dict] = rows) -> None:
            rows.append(row)
            emit(row)

        throughput(name, args.sizes, args.repeats, keep)
        best[name] = rows[-1]["get_gbps"]
    largest = max(args.sizes)
    # the consumer copies with 1 torch thread (a worker's share of 2 cores): compare like with like
    ceiling = memcpy_gbps(largest * MiB, args.repeats, 1)
    winner = max(best, key=best.get)
    emit(
        {
            "kind": "summary",
            "payload_mib": largest,
            "best_transport": winner,
            "best_get_gbps": best[winner],
            "memcpy_1thread_gbps": ceiling,
            "best_get_fraction_of_memcpy": best[winner] / ceiling,
            "target_fraction": 0.5,
        }
    )


if __name__ == "__main__":
    main()
