"""A step on a shared CPU: each tiny recipe idle and beside a pinned one-core busy loop (issue 47).

One run measures, one after another on the same machine, for the diffusion recipe
(`diffusion/tiny_sd3_flowgrpo`) and the text recipe (`llm/tiny_lm_grpo`):

- **unirl**: the recipe through its command line (`python -m unirl.train_diffusion` /
  `unirl.train_vlm`: Ray, one worker), its torch threads governed (`ThreadGovernor`,
  `unirl/distributed/cores.py`): the default;
- **unirl_fixed**: the same with `threads_per_worker=<usable cores>`: the thread count fixed, as
  every worker ran before the governor;
- **unirl_1thread** (idle only): `threads_per_worker=1`: the step with one core, the floor of
  any step that has one free core (torch's OpenMP gives each thread an equal share of an op, so
  a thread on the shared core makes the op wait for it);
- **bare**: the same model work in one plain process with the usable cores as torch threads and
  no framework: for diffusion the bare loop of `benchmarks/framework_overhead.py` (`run_bare`),
  for text transformers' `generate` of the recipe's batch, a no-grad forward (the old
  log-probs), and per micro-batch a forward and backward of the policy-gradient loss, then AdamW.

"busy" is a process spinning on the last core of this process's affinity for the whole run.
Each run is a fresh process of `--steps` measured steps after one warm-up step; the median step
(`time/step_s` of the run's metric rows; the bare loops time theirs the same way) is reported.
Output: JSON lines (stdout and `--out`), one per run and one summary per recipe with the ratios
busy / idle of each side, the governed idle step over the fixed one (its idle cost), and the
one-thread floor (idle one-thread step over the idle governed step), against the issue's 1.5x.

    python benchmarks/contention.py [--steps 4] [--tracks diffusion text] [--out FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "contention.jsonl")
TARGET = 1.5  # issue 47: a step beside one busy core at most 1.5x its idle time


@dataclass(frozen=True)
class Track:
    entry: str  # the command line's module
    recipe: str


TRACKS = {
    "diffusion": Track("unirl.train_diffusion", "diffusion/tiny_sd3_flowgrpo"),
    "text": Track("unirl.train_vlm", "llm/tiny_lm_grpo"),
}


def usable() -> int:
    from unirl.distributed.cores import usable_cores

    return usable_cores()


@contextlib.contextmanager
def busy_core(on: bool) -> Iterator[int | None]:
    """With `on`, a process spinning on the last core of the affinity for the block; yields its core."""
    if not on:
        yield None
        return
    core = max(os.sched_getaffinity(0))
    spin = f"import os\nos.sched_setaffinity(0, {{{core}}})\nwhile True:\n    pass\n"
    proc = subprocess.Popen([sys.executable, "-c", spin])
    try:
        time.sleep(0.5)  # spinning before the run starts
        yield core
    finally:
        proc.kill()
        proc.wait()


def run_unirl(track: Track, steps: int, threads: int | None, out_dir: str) -> dict[str, Any]:
    """The recipe through its command line; its step times (the warm-up step dropped) and the
    worker's thread count at the last step."""
    cmd = [
        sys.executable, "-m", track.entry, f"--config-name={track.recipe}",
        f"num_steps={steps + 1}", f"output_dir={out_dir}",
        "logging.progress=false", "logging.save_images_every=0",
    ]  # fmt: skip
    if threads is not None:
        cmd.append(f"threads_per_worker={threads}")
    env = {**os.environ, "RAY_ADDRESS": "local", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [r for r in map(json.loads, f) if "time/step_s" in r]
    return {
        "step_s": [r["time/step_s"] for r in rows[1:]],
        "threads_at_end": rows[-1].get("cpu/threads"),
        "others_load_at_end": rows[-1].get("cpu/others_load"),
    }


def run_bare(track_name: str, steps: int) -> dict[str, Any]:
    """The bare loop of `track_name` in a fresh process (this script with `--bare`)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--bare", track_name, "--steps", str(steps)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ---- the bare loops (run in a child process) --------------------------------------------------
def bare_diffusion(steps: int, threads: int) -> list[float]:
    sys.path.insert(0, os.path.join(REPO, "benchmarks"))
    import framework_overhead as fo

    with tempfile.TemporaryDirectory(prefix="unirl_contention_") as tmp:
        rows, _ = fo.run_bare(fo.compose_recipe(steps + 1, tmp), steps + 1, threads)
    return [r["time/step_s"] for r in rows[1:]]


def bare_text(steps: int, threads: int) -> list[float]:
    """The text recipe's model work in plain transformers: per step, `generate` of prompts x
    samples, one no-grad forward of the sequences, a forward + backward per micro-batch of a
    policy-gradient loss on the response tokens, one AdamW step."""
    import torch
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from unirl.trainer.worker import build, quiet_library_logs

    quiet_library_logs()
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    with initialize_config_dir(config_dir=os.path.join(REPO, "examples"), version_base=None):
        cfg = compose(config_name=TRACKS["text"].recipe)
    c = OmegaConf.to_container(cfg, resolve=True)
    bundle = build(c["model"]).build()
    model, tok = bundle.model, bundle.tokenizer
    sp = c["sampling"]
    source = build(c["data_source"])
    prompts = [ex.prompt for ex in source.examples][: int(c["prompts_per_rollout"])]
    k, mbs = int(sp["samples_per_prompt"]), int(c["train"]["stack"]["micro_batch_size"])
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
             for p in prompts for _ in range(k)]  # fmt: skip
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True)
    opt = torch.optim.AdamW(model.parameters(), lr=float(c["train"]["optim"]["lr"]), weight_decay=0.0)
    times = []
    for _ in range(steps + 1):
        t0 = time.perf_counter()
        with torch.no_grad():
            seqs = model.generate(
                **enc, do_sample=True, temperature=float(sp["temperature"]), top_k=0, top_p=1.0,
                max_new_tokens=int(sp["max_new_tokens"]), pad_token_id=tok.pad_token_id,
            )  # fmt: skip
        mask = (seqs != tok.pad_token_id).long()
        prompt_len = enc["input_ids"].shape[1]
        with torch.no_grad():
            old = torch.log_softmax(model(input_ids=seqs, attention_mask=mask).logits[:, :-1].float(), -1)
            old = old.gather(-1, seqs[:, 1:, None]).squeeze(-1)
        adv = torch.randn(seqs.shape[0])
        for start in range(0, seqs.shape[0], mbs):
            sl = slice(start, start + mbs)
            logits = model(input_ids=seqs[sl], attention_mask=mask[sl]).logits[:, :-1].float()
            logp = torch.log_softmax(logits, -1).gather(-1, seqs[sl, 1:, None]).squeeze(-1)
            ratio = (logp - old[sl]).exp()[:, prompt_len - 1 :]
            (-(ratio * adv[sl, None]).mean()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
    return times[1:]


# ---- report -----------------------------------------------------------------------------------
def median(run: dict[str, Any]) -> float:
    return statistics.median(run["step_s"])


def measure(track_name: str, steps: int, cores: int) -> list[dict[str, Any]]:
    """Every side of one recipe, idle and busy; one line per run and a summary line."""
    track = TRACKS[track_name]
    plan = [
        ("unirl", None, False), ("unirl", None, True),
        ("unirl_fixed", cores, False), ("unirl_fixed", cores, True),
        ("unirl_1thread", 1, False),
        ("bare", None, False), ("bare", None, True),
    ]  # fmt: skip
    lines, med = [], {}
    for side, threads, busy in plan:
        with busy_core(busy) as core, tempfile.TemporaryDirectory(prefix="unirl_contention_") as tmp:
            t0 = time.perf_counter()
            run = run_bare(track_name, steps) if side == "bare" else run_unirl(track, steps, threads, tmp)
            wall = time.perf_counter() - t0
        load = "busy" if busy else "idle"
        med[(side, load)] = median(run)
        lines.append(
            {
                "bench": "contention", "recipe": track.recipe, "side": side, "load": load,
                "busy_core": core, "threads": threads if side != "bare" else cores,
                "median_step_s": round(med[(side, load)], 4), **run, "wall_s": round(wall, 1),
            }  # fmt: skip
        )
        print(json.dumps(lines[-1]), flush=True)

    def ratio(a: tuple[str, str], b: tuple[str, str]) -> float:
        return round(med[a] / med[b], 3)

    lines.append(
        {
            "bench": "contention",
            "recipe": track.recipe,
            "summary": True,
            "busy_over_idle": {
                side: ratio((side, "busy"), (side, "idle")) for side in ("unirl", "unirl_fixed", "bare")
            },
            "idle_governed_over_fixed": ratio(("unirl", "idle"), ("unirl_fixed", "idle")),
            "one_thread_floor": ratio(("unirl_1thread", "idle"), ("unirl", "idle")),
            "target_busy_over_idle": TARGET,
            "meets_target": med[("unirl", "busy")] <= TARGET * med[("unirl", "idle")],
        }
    )
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=4, help="measured steps per run (plus 1 warm-up step)")
    ap.add_argument("--tracks", nargs="+", choices=sorted(TRACKS), default=["diffusion", "text"])
    ap.add_argument("--out", default=DEFAULT_OUT, help="JSONL file to append the lines to")
    ap.add_argument("--bare", choices=sorted(TRACKS), help=argparse.SUPPRESS)  # a bare loop's child process
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    cores = usable()
    if args.bare:
        fn = bare_diffusion if args.bare == "diffusion" else bare_text
        print(json.dumps({"step_s": fn(args.steps, cores)}))
        return 0
    if cores < 2:
        ap.error(f"this process may use {cores} core: a busy core would leave none free")
    common = {"cpu_count": os.cpu_count(), "usable_cores": cores, "steps": args.steps,
              "timestamp": time.strftime("%Y-%m-%dT%H:%M:%S")}  # fmt: skip
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for name in args.tracks:
        for line in measure(name, args.steps, cores):
            with open(args.out, "a") as f:
                f.write(json.dumps({**line, **common}) + "\n")
            if line.get("summary"):
                print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
