"""Framework overhead of a diffusion RL step: UniRL (Ray driver + worker) vs a bare loop.

One run measures, side by side and with the same sizes, seeds and torch
thread count:

1. **framework**: the tiny recipe (`examples/diffusion/tiny_sd3_flowgrpo.yaml`)
   composed with Hydra, validated, and run by `Trainer(cfg).run()`
   (starts Ray, a placement group and one `RLWorker` actor). Per-step
   `time/rollout_s`, `time/reward_s`, `time/train_s` and `time/step_s` come
   from the metric rows the trainer returns.
2. **bare**: the same model work in this process with no framework: the same
   tiny SD3 transformer with the same LoRA (peft) and AdamW; per step the
   prompts are encoded once with the pipeline's `encode_prompt`, the batch is
   sampled with CFG (one forward of 2B per denoising step) on the same SDE
   steps, the colour reward and group advantages are computed inline, and
   training replays the SDE steps per micro-batch in chunks of
   `replay_steps_per_forward` (one forward with grad per chunk, PPO-clip
   loss, backward), then clips gradients and steps. The numerics are the
   project's own, called directly: the sigma schedule (`sigmas_for`), the
   SDE-step choice (`resolve_sde_indices`) and the SDE step with its log-prob
   (the stage's strategy), so the two sides cannot drift apart; what differs
   is the framework around them.

The first step of each side is a warm-up and is excluded; the median over the
remaining steps is reported. Output is JSON lines (stdout and `--out`): one
line per phase and one summary line (overhead as a fraction of the framework
step, against a 10% target, plus peak memory).

    python benchmarks/framework_overhead.py [--steps N] [--out FILE]
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import resource
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Always start a private local Ray instance: without this, `ray.init()` in the trainer attaches to
# whatever cluster /tmp/ray/ray_current_cluster names (e.g. another user's test run) and then fails
# because the trainer passes num_cpus.
os.environ["RAY_ADDRESS"] = "local"

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

import torch  # noqa: E402
from omegaconf import DictConfig, OmegaConf  # noqa: E402

EXAMPLES = os.path.join(REPO, "examples")
RECIPE = "diffusion/tiny_sd3_flowgrpo"
DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "framework_overhead.jsonl")
TARGET_FRACTION = 0.10
PHASES = ("rollout", "reward", "train", "step")
BENCH = "framework_overhead"


# ---- memory -----------------------------------------------------------------------------------
def _status_kb(pid: int | str, key: str) -> int | None:
    """A `kB` field (VmRSS, VmHWM) of /proc/<pid>/status, or None."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _reset_peak_rss() -> bool:
    """Reset this process's VmHWM (Linux >= 4.0: write 5 to clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakMemoryMonitor(threading.Thread):
    """Polls peak RSS (VmHWM) of this process and of Ray's `RLWorker` processes.

    Ray workers are descendants of the driver (driver -> raylet -> worker);
    they are found with psutil when installed, else by scanning /proc for the
    `ray::RLWorker` process title. The last VmHWM seen before the
    actor is killed is its peak.
    """

    def __init__(self, interval_s: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.interval_s = interval_s
        self.worker_hwm_kb: dict[int, int] = {}
        self.self_rss_max_kb = 0
        self.method = "none"
        self._halt = threading.Event()

    def _candidate_pids(self) -> list[int]:
        try:
            import psutil

            self.method = "psutil children + /proc/<pid>/status VmHWM"
            return [p.pid for p in psutil.Process().children(recursive=True)]
        except Exception:  # noqa: BLE001 - psutil missing or a child vanished: scan /proc instead
            self.method = "/proc scan + /proc/<pid>/status VmHWM"
            return [int(d) for d in os.listdir("/proc") if d.isdigit()]

    def poll(self) -> None:
        rss = _status_kb("self", "VmRSS")
        if rss:
            self.self_rss_max_kb = max(self.self_rss_max_kb, rss)
        # Scan for the worker only until found (a full scan costs a few ms of driver CPU).
        pids = list(self.worker_hwm_kb) or [p for p in self._candidate_pids() if "RLWorker" in _cmdline(p)]
        for pid in pids:
            hwm = _status_kb(pid, "VmHWM")
            if hwm:
                self.worker_hwm_kb[pid] = max(self.worker_hwm_kb.get(pid, 0), hwm)

    def run(self) -> None:
        while not self._halt.wait(self.interval_s):
            self.poll()

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


@contextmanager
def monitored() -> Iterator[PeakMemoryMonitor]:
    mon = PeakMemoryMonitor()
    mon.start()
    try:
        yield mon
    finally:
        mon.stop()


def _mb(kb: int | None) -> float | None:
    return None if not kb else round(kb / 1024.0, 1)


# ---- config -----------------------------------------------------------------------------------
def compose_recipe(num_steps: int, output_dir: str) -> DictConfig:
    """The tiny recipe composed as the CLI would, with `num_steps`/`output_dir` overridden."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        cfg = compose(
            config_name=RECIPE,
            overrides=[f"num_steps={num_steps}", f"output_dir={output_dir}", "logging.progress=false"],
        )
    from unirl.config.validate import validate_recipe

    validate_recipe(cfg)
    return cfg


def worker_threads(cfg: DictConfig) -> int:
    """The torch thread count `RLWorker.__init__` sets."""
    return int(cfg.get("threads_per_worker") or max(1, (os.cpu_count() or 1) // int(cfg.num_devices)))


# ---- framework --------------------------------------------------------------------------------
def run_framework(cfg: DictConfig) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Run the recipe through `Trainer`; returns (metric rows, memory info)."""
    from unirl.trainer.trainer import Trainer

    with monitored() as mon:
        rows = Trainer(cfg).run()
        mon.poll()
    mem = {
        "framework_worker_peak_rss_mb": _mb(max(mon.worker_hwm_kb.values(), default=0)),
        "framework_worker_pids": sorted(mon.worker_hwm_kb),
        "framework_driver_peak_rss_mb": _mb(_status_kb("self", "VmHWM")),
        "memory_method": mon.method,
    }
    return rows, mem


# ---- bare loop --------------------------------------------------------------------------------
class _Prompts:
    """The default prompt list in per-epoch shuffled order (as `DefaultDataSource`)."""

    def __init__(self, prompts: list[str], seed: int) -> None:
        self.prompts, self.seed, self.epoch, self.pos = prompts, seed, 0, 0
        self.order = self._order()

    def _order(self) -> list[int]:
        order = list(range(len(self.prompts)))
        random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def next(self, n: int) -> list[str]:
        if self.pos + n > len(self.prompts):
            self.epoch, self.pos = self.epoch + 1, 0
            self.order = self._order()
        idx = self.order[self.pos : self.pos + n]
        self.pos += n
        return [self.prompts[i] for i in idx]


def run_bare(cfg: DictConfig, num_steps: int, threads: int) -> tuple[list[dict[str, float]], dict[str, Any]]:
    """The recipe's model work with no framework; returns (per-step rows, memory info)."""
    from peft import LoraConfig

    from unirl.data.data_source import DEFAULT_PROMPTS
    from unirl.models.sd3 import SD3ModelConfig, TinySD3Config
    from unirl.sde import make_strategy, sigmas_for
    from unirl.trainer.worker import quiet_library_logs
    from unirl.types import DiffusionSamplingParams

    c: dict[str, Any] = OmegaConf.to_container(cfg, resolve=True)  # type: ignore[assignment]
    sp, lora, optim = c["sampling"], c["train"]["lora"], c["train"]["optim"]
    mbs = int(c["train"]["stack"]["micro_batch_size"])
    replay_n = int(c["stage"]["replay_steps_per_forward"])
    fbs = c["rollout"].get("forward_batch_size")
    adv_clip = c["advantage"].get("clip")
    clip_range = float(c["algorithm"]["config"]["clip_range"])
    target = torch.tensor(c["reward"]["backend"]["components"]["redness"]["target"]).view(1, 3, 1, 1)
    seed, k, gscale, eta = (
        int(c["seed"]),
        int(sp["samples_per_prompt"]),
        float(sp["guidance_scale"]),
        float(sp["eta"]),
    )

    quiet_library_logs()
    had_reset = _reset_peak_rss()
    torch.set_num_threads(threads)
    torch.manual_seed(seed)
    tiny = {key: v for key, v in c["model"]["tiny"].items()}
    bundle = SD3ModelConfig(tiny=TinySD3Config(**tiny)).build()  # construction only
    pipe = bundle.pipeline
    tr = pipe.transformer
    tr.requires_grad_(False)
    tr.add_adapter(
        LoraConfig(
            r=int(lora["rank"]),
            lora_alpha=float(lora["alpha"]),
            lora_dropout=float(lora.get("dropout", 0.0)),
            target_modules=list(lora["target_modules"]),
            init_lora_weights=True,
        )
    )
    params = [p for p in tr.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(
        params,
        lr=float(optim["lr"]),
        betas=tuple(optim.get("betas", (0.9, 0.999))),
        weight_decay=float(optim["weight_decay"]),
        eps=float(optim.get("eps", 1e-8)),
    )
    max_norm = float(optim["max_grad_norm"])
    sampling = DiffusionSamplingParams(**{key: v for key, v in sp.items() if key != "_target_"})
    sigmas = sigmas_for(sampling, bundle.image_seq_len(sampling.height, sampling.width))
    strategy = make_strategy(c["stage"].get("sde", "flow"), eta)
    shape = (tr.config.in_channels, int(sp["height"]), int(sp["width"]))  # pixel space: no VAE
    n_prompts = int(c["prompts_per_rollout"])
    batch = n_prompts * k
    fbs = batch if fbs is None else int(fbs)
    prompt_src = _Prompts(list(DEFAULT_PROMPTS), int(c["data_source"].get("seed", seed)))
    rows: list[dict[str, float]] = []

    for step in range(num_steps):
        t0 = time.perf_counter()
        # ---- rollout: encode once, sample with CFG + SDE steps, decode (pixel space) ----
        prompts = prompt_src.next(n_prompts)
        sde = sampling.resolve_sde_indices(step)
        positions = sorted({p for i in sde for p in (i, i + 1)})
        gen = torch.Generator().manual_seed(hash((seed, step)) & 0x7FFF_FFFF)
        tr.eval()
        with torch.no_grad():
            pe, npe, pp, npp = pipe.encode_prompt(
                prompt=prompts,
                prompt_2=None,
                prompt_3=None,
                device=torch.device("cpu"),
                do_classifier_free_guidance=gscale > 1.0,
                max_sequence_length=int(sp["max_sequence_length"]),
            )
            pe, npe, pp, npp = (t.float().repeat_interleave(k, dim=0) for t in (pe, npe, pp, npp))
            stored: dict[int, list[torch.Tensor]] = {p: [] for p in positions}
            logps: list[torch.Tensor] = []
            finals: list[torch.Tensor] = []
            for lo in range(0, batch, fbs):
                sl = slice(lo, min(lo + fbs, batch))
                n = sl.stop - sl.start
                emb, pooled = torch.cat([npe[sl], pe[sl]]), torch.cat([npp[sl], pp[sl]])
                x = torch.randn((n, *shape), generator=gen)
                chunk_lps = []
                for i in range(int(sp["num_steps"])):
                    if i in stored:
                        stored[i].append(x)
                    ts = (sigmas[i] * 1000.0).expand(2 * n)
                    out = tr(
                        hidden_states=torch.cat([x, x]),
                        timestep=ts,
                        encoder_hidden_states=emb,
                        pooled_projections=pooled,
                        return_dict=False,
                    )[0]
                    v_u, v_c = out.chunk(2)
                    v = v_u + gscale * (v_c - v_u)
                    noise = torch.randn((n, *shape), generator=gen) if i in sde else None
                    step_out = strategy.step(x, v, sigmas, i, sde=i in sde, noise=noise)
                    if step_out.log_prob is not None:
                        chunk_lps.append(step_out.log_prob)
                    x = step_out.next_sample
                finals.append(x)
                logps.append(torch.stack(chunk_lps, dim=1))
            lat = {p: torch.cat(v) for p, v in stored.items() if v}
            lat[int(sp["num_steps"])] = torch.cat(finals)
            old_logp = torch.cat(logps)
            images = ((lat[int(sp["num_steps"])].clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8)
        t1 = time.perf_counter()
        # ---- reward (colour target) and group advantages ----
        rewards = 1.0 - (images.float() / 255.0 - target).abs().mean(dim=(1, 2, 3))
        g = rewards.view(n_prompts, k)
        adv = (
            (g - g.mean(dim=1, keepdim=True)) / (g.std(dim=1, unbiased=False, keepdim=True) + 1e-4)
        ).reshape(-1)
        if adv_clip is not None:
            adv = adv.clamp(-float(adv_clip), float(adv_clip))
        t2 = time.perf_counter()
        # ---- train: per micro-batch, SDE steps in chunks, PPO-clip, one optimizer step ----
        tr.train()
        opt.zero_grad(set_to_none=True)
        n_micro = batch // mbs
        loss_sum = 0.0
        for m in range(n_micro):
            sl = slice(m * mbs, (m + 1) * mbs)
            for j0 in range(0, len(sde), replay_n):
                steps = sde[j0 : j0 + replay_n]
                r = len(steps)
                x = torch.cat([lat[i][sl] for i in steps])
                ts = torch.cat([(sigmas[i] * 1000.0).expand(mbs) for i in steps])
                neg_e, pos_e = npe[sl].repeat(r, 1, 1), pe[sl].repeat(r, 1, 1)
                neg_p, pos_p = npp[sl].repeat(r, 1), pp[sl].repeat(r, 1)
                out = tr(
                    hidden_states=torch.cat([x, x]),
                    timestep=torch.cat([ts, ts]),
                    encoder_hidden_states=torch.cat([neg_e, pos_e]),
                    pooled_projections=torch.cat([neg_p, pos_p]),
                    return_dict=False,
                )[0]
                v_u, v_c = out.chunk(2)
                v_all = v_u.detach() + gscale * (v_c - v_u.detach())
                new_lp = []
                for q, i in enumerate(steps):
                    rows_q = slice(q * mbs, (q + 1) * mbs)
                    replayed = strategy.step(
                        x[rows_q], v_all[rows_q], sigmas, i, sde=True, next_sample=lat[i + 1][sl]
                    )
                    new_lp.append(replayed.log_prob)
                new_logp = torch.stack(new_lp, dim=1)
                old = old_logp[sl][:, [sde.index(i) for i in steps]]
                ratio = torch.exp(new_logp - old)
                a = adv[sl].unsqueeze(1)
                loss = torch.maximum(-a * ratio, -a * ratio.clamp(1 - clip_range, 1 + clip_range)).mean()
                (loss * (r / len(sde)) / n_micro).backward()
                loss_sum += float(loss.detach()) * r / len(sde) / n_micro
        torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        rows.append(
            {
                "step": step + 1,
                "reward/mean": float(rewards.mean()),
                "loss": loss_sum,
                "time/rollout_s": t1 - t0,
                "time/reward_s": t2 - t1,
                "time/train_s": t3 - t2,
                "time/step_s": t3 - t0,
            }
        )
    mem = {
        "bare_peak_rss_mb": _mb(_status_kb("self", "VmHWM")),
        "bare_peak_rss_is_phase_only": had_reset,
        "process_ru_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0, 1),
    }
    del tr, pipe, bundle, opt, params
    gc.collect()
    return rows, mem


# ---- report -----------------------------------------------------------------------------------
def _median(rows: list[dict[str, Any]], phase: str) -> float:
    return statistics.median(float(r[f"time/{phase}_s"]) for r in rows)


def build_report(
    fw_rows: list[dict[str, Any]],
    bare_rows: list[dict[str, Any]],
    mem: dict[str, Any],
    common: dict[str, Any],
) -> list[dict[str, Any]]:
    """One line per phase plus a summary line (warm-up rows already dropped)."""
    lines: list[dict[str, Any]] = []
    for phase in PHASES:
        fw, bare = _median(fw_rows, phase), _median(bare_rows, phase)
        lines.append(
            {
                "bench": BENCH,
                "phase": phase,
                "framework_s": round(fw, 5),
                "bare_s": round(bare, 5),
                "overhead_s": round(fw - bare, 5),
                "overhead_ratio": round(fw / bare - 1, 4) if bare > 0 else None,
                "framework_min_s": round(min(float(r[f"time/{phase}_s"]) for r in fw_rows), 5),
                "bare_min_s": round(min(float(r[f"time/{phase}_s"]) for r in bare_rows), 5),
                "framework_per_step_s": [round(float(r[f"time/{phase}_s"]), 4) for r in fw_rows],
                "bare_per_step_s": [round(float(r[f"time/{phase}_s"]), 4) for r in bare_rows],
                **common,
            }
        )
    fw_step, bare_step = _median(fw_rows, "step"), _median(bare_rows, "step")
    frac = (fw_step - bare_step) / fw_step
    fw_min = min(float(r["time/step_s"]) for r in fw_rows)
    bare_min = min(float(r["time/step_s"]) for r in bare_rows)
    note = (
        "worker peak RSS is VmHWM of the ray::RLWorker process polled from the driver; "
        "bare peak RSS is this process's VmHWM reset before the bare loop (it includes the driver's "
        "imports: torch, ray, hydra) when bare_peak_rss_is_phase_only, else the process-wide peak; "
        "framework_driver_peak_rss_mb is the benchmark process during the framework run (Ray client + driver)."
    )
    if not mem.get("framework_worker_peak_rss_mb"):
        note = "worker process not found; " + note
    lines.append(
        {
            "bench": BENCH,
            "phase": "summary",
            "framework_step_s": round(fw_step, 5),
            "bare_step_s": round(bare_step, 5),
            "overhead_fraction_of_step": round(frac, 4),
            "overhead_fraction_of_step_by_min": round((fw_min - bare_min) / fw_min, 4),
            "target_fraction": TARGET_FRACTION,
            "target_met": frac <= TARGET_FRACTION,
            "framework_reward_mean_last": round(float(fw_rows[-1]["reward/mean"]), 4),
            "bare_reward_mean_last": round(float(bare_rows[-1]["reward/mean"]), 4),
            **mem,
            "note": note,
            **common,
        }
    )
    return lines


def _block(side: str, rnd: int, load0: float, t0: float) -> dict[str, Any]:
    """Wall time and 1-min load average around one measured block (contention shows here)."""
    return {
        "side": side,
        "round": rnd,
        "wall_s": round(time.perf_counter() - t0, 2),
        "loadavg_1m_start": round(load0, 2),
        "loadavg_1m_end": round(os.getloadavg()[0], 2),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=8, help="measured steps per side (plus 1 warm-up step)")
    ap.add_argument("--out", default=DEFAULT_OUT, help="JSONL file to append the report lines to")
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="alternate framework and bare blocks this many times (medians pool all rounds)",
    )
    args = ap.parse_args(argv)
    if args.steps < 1 or args.rounds < 1:
        ap.error("--steps and --rounds must be >= 1")
    total = args.steps + 1

    fw_rows: list[dict[str, Any]] = []
    bare_rows: list[dict[str, Any]] = []
    mem: dict[str, Any] = {}
    loadavg: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="unirl_bench_") as tmp:
            cfg = compose_recipe(total, tmp)
            threads = worker_threads(cfg)
            load0, t0 = os.getloadavg()[0], time.perf_counter()
            rows, fw_mem = run_framework(cfg)
            loadavg.append(_block("framework", rnd, load0, t0))
            fw_rows += rows[1:]
        load0, t0 = os.getloadavg()[0], time.perf_counter()
        rows, bare_mem = run_bare(cfg, total, threads)
        loadavg.append(_block("bare", rnd, load0, t0))
        bare_rows += rows[1:]
        for key, val in {**fw_mem, **bare_mem}.items():
            prev = mem.get(key)
            mem[key] = max(prev, val) if isinstance(val, float) and isinstance(prev, float) else val

    sp = cfg.sampling
    common = {
        "steps": args.steps,
        "rounds": args.rounds,
        "warmup_steps": 1,
        "torch": torch.__version__,
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "batch": int(cfg.prompts_per_rollout) * int(sp.samples_per_prompt),
        "denoise_steps": int(sp.num_steps),
        "sde_steps": int(sp.sde_num_steps),
        "recipe": RECIPE,
        "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    mem["blocks"] = loadavg
    lines = build_report(fw_rows, bare_rows, mem, common)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        for line in lines:
            text = json.dumps(line)
            print(text, flush=True)
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
