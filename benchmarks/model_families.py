"""Per model family on the shared flow-matching stage: step time and peak memory on its tiny recipe,
and the stage's overhead vs calling the family's diffusers pipeline for the same ODE sampling.

Two parts, in one run (`--part train|overhead|both`, default both):

- **train**: each family's tiny Flow-GRPO recipe (`examples/diffusion/tiny_<family>_flowgrpo.yaml`)
  through the real entry point (`python -m unirl.train_diffusion`, `launcher=in_process
  transport=inband`, `--threads` torch threads), `--train-steps` steps, families one after the
  other. From the run's `metrics.jsonl`: the medians after the first (warm-up) step of
  `time/rollout_s`, `time/train_s`, `time/step_s`, and the largest `memory/worker_peak_rss_mb`
  (the worker's VmHWM; in-process the worker is the whole training process). The table also
  gives the fastest step after the warm-up (the least disturbed on a shared machine).
- **overhead**: in this process, each family's tiny latent-space model built as its pipeline
  parity test builds it (`tests/models/<family>/test_pipeline_parity.py`: same configs, prompts,
  seeds, schedule pin, guidance), eta 0, `--ode-steps` steps. Side A is our stage
  (`encode_prompts` + `FlowMatchingStage.diffuse`, x_T drawn inside from the request's seeds);
  side B is `<Family>Pipeline.__call__` with the same x_T (`latents=`) and `output_type="latent"`
  (its own prompt encoding, schedule, CFG / embedded guidance). Calls alternate A B A B ...
  (`--repeats` pairs after one warm-up pair); the ratio is A / B per pair, reported as the median
  with its min and max, and the ratio of the minima. The max |A - B| of the final latents is
  reported as a check that both sides did the same work.

    python benchmarks/model_families.py [--part both] [--only sd3,flux,wan,qwenimage]
        [--train-steps 3] [--ode-steps 10] [--repeats 7] [--threads 2]
        [--out benchmarks/results/model_families.jsonl]

Writes one JSON line per family and part (plus the 1-minute load average around it) and prints
markdown tables. No network: every model is built from configs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

FAMILIES = {
    "sd3": "diffusion/tiny_sd3_flowgrpo",
    "flux": "diffusion/tiny_flux_flowgrpo",
    "wan": "diffusion/tiny_wan_flowgrpo",
    "qwenimage": "diffusion/tiny_qwenimage_flowgrpo",
}
# the recipes' prompt geometry (prompts_per_rollout 4); words every tiny tokenizer has as whole
# tokens (the tiny Qwen-Image's vocabulary is the parity test's WORDS), all of one token length
PROMPTS = ["a red square", "a blue dot", "a blue square", "a red dot"]
QWEN_WORDS = ["red", "blue", "square", "dot"]


def load1() -> float:
    return os.getloadavg()[0]


# ---- part 1: the tiny recipes ---------------------------------------------------------------
def run_recipe(family: str, steps: int, threads: int, workdir: str) -> dict:
    """Run `family`'s tiny recipe for `steps` steps in-process; its per-step medians and peak RSS."""
    recipe = FAMILIES[family]
    out_dir = os.path.join(workdir, family)
    cmd = [
        sys.executable, "-m", "unirl.train_diffusion", f"--config-name={recipe}",
        "++launcher=in_process", "transport=inband", f"threads_per_worker={threads}",
        f"num_steps={steps}", f"output_dir={out_dir}", "logging.save_images_every=0",
        "logging.progress=false",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1"}
    load_before, t0 = load1(), time.perf_counter()
    with open(os.path.join(workdir, f"{family}.log"), "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.perf_counter() - t0
    path = os.path.join(out_dir, "metrics.jsonl")
    rows = [json.loads(line) for line in open(path) if line.strip()] if os.path.exists(path) else []
    if rc != 0 or len(rows) < 2:
        raise RuntimeError(f"{family}: exit {rc}, {len(rows)} metric rows; see {log.name}")
    after = rows[1:]  # the first step is a warm-up
    out = {"part": "train", "family": family, "recipe": recipe, "steps": len(rows), "threads": threads}
    for key in ("rollout_s", "reward_s", "train_s", "step_s"):
        out[key] = statistics.median(float(r[f"time/{key}"]) for r in after)
        out[f"{key}_per_step"] = [float(r[f"time/{key}"]) for r in rows]
    out["peak_rss_mb"] = max(float(r.get("memory/worker_peak_rss_mb", float("nan"))) for r in rows)
    out.update(wall_s=wall, load1_before=load_before, load1_after=load1())
    return out


# ---- part 2: the stage vs the diffusers pipeline --------------------------------------------
def build_side_by_side(family: str, ode_steps: int):
    """(stage, pipe, sp, pipeline kwargs without latents, pack, unpack) for `family`, built as its
    pipeline parity test builds them."""
    from unirl.types import DiffusionSamplingParams

    def identity(x, *_):
        return x

    common = dict(num_steps=ode_steps, samples_per_prompt=2, eta=0.0, max_sequence_length=8)
    if family == "sd3":
        from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

        from unirl.models.sd3 import SD3ModelConfig, SD3Stage, TinySD3Config

        bundle = SD3ModelConfig(
            tiny=TinySD3Config(resolution=16, patch_size=4, num_layers=1, clip_max_length=8, seed=0, pixel_space=False)
        ).build()
        sp = DiffusionSamplingParams(height=16, width=16, guidance_scale=3.0, shift=3.0, **common)
        scheduler = FlowMatchEulerDiscreteScheduler(shift=sp.shift)
        pipe = StableDiffusion3Pipeline(**{**bundle.pipeline.components, "scheduler": scheduler})
        kwargs = dict(num_images_per_prompt=2, guidance_scale=sp.guidance_scale)
        return SD3Stage(bundle), pipe, sp, kwargs, identity, identity
    if family == "flux":
        from diffusers import FluxPipeline

        from unirl.models.flux import FluxModelConfig, FluxStage, TinyFluxConfig
        from unirl.models.flux.bundle import pack, unpack

        bundle = FluxModelConfig(
            tiny=TinyFluxConfig(resolution=32, pixel_space=False, clip_max_length=8, seed=0)
        ).build()
        sp = DiffusionSamplingParams(
            height=32, width=32, guidance_scale=3.5, dynamic_shift=True, sigma_grid="steps", **common
        )
        kwargs = dict(num_images_per_prompt=2, guidance_scale=sp.guidance_scale)
        return FluxStage(bundle), FluxPipeline(**bundle.pipeline.components), sp, kwargs, pack, unpack
    if family == "wan":
        from diffusers import WanPipeline

        from unirl.models.wan import TinyWanConfig, WanModelConfig, WanStage

        bundle = WanModelConfig(tiny=TinyWanConfig(resolution=16, pixel_space=False, seed=0), num_frames=5).build()
        sp = DiffusionSamplingParams(height=16, width=16, guidance_scale=5.0, shift=3.0, **common)
        kwargs = dict(num_videos_per_prompt=2, guidance_scale=sp.guidance_scale, num_frames=bundle.num_frames)
        return WanStage(bundle), WanPipeline(**bundle.pipeline.components), sp, kwargs, identity, identity
    if family == "qwenimage":
        from diffusers import QwenImagePipeline

        from unirl.models.qwenimage import QwenImageModelConfig, QwenImageStage, TinyQwenImageConfig
        from unirl.models.qwenimage.bundle import pack, unpack

        bundle = QwenImageModelConfig(
            tiny=TinyQwenImageConfig(resolution=32, pixel_space=False, words=QWEN_WORDS, seed=0)
        ).build()
        bundle.negative_prompt = "a blue square"  # as long as the prompts: the parity test's bit-exact case
        sp = DiffusionSamplingParams(
            height=32, width=32, guidance_scale=4.0, dynamic_shift=True, max_seq_len=8192, max_shift=0.9,
            sigma_grid="steps", **common,
        )  # fmt: skip
        kwargs = dict(
            num_images_per_prompt=2,
            true_cfg_scale=sp.guidance_scale,
            negative_prompt=[bundle.negative_prompt] * len(PROMPTS),
        )
        return QwenImageStage(bundle), QwenImagePipeline(**bundle.pipeline.components), sp, kwargs, pack, unpack
    raise ValueError(f"unknown family {family!r}; known: {sorted(FAMILIES)}")


def overhead(family: str, ode_steps: int, repeats: int, threads: int, profile: bool = False) -> dict:
    """Interleaved A (stage) / B (pipeline) timings of the same eta-0 sampling for `family`."""
    import torch

    from unirl.sde.schedules import sigmas_for
    from unirl.types import PromptExample, RolloutReq

    torch.manual_seed(0)
    stage, pipe, sp, kwargs, pack, unpack = build_side_by_side(family, ode_steps)
    pipe.set_progress_bar_config(disable=True)
    bundle = stage.bundle
    sigmas = sigmas_for(sp, bundle.image_seq_len(sp.height, sp.width))
    req = RolloutReq.from_prompts([PromptExample(p, str(i)) for i, p in enumerate(PROMPTS)], sp, sigmas, 0)
    shape = bundle.latent_shape(sp.height, sp.width)
    x_t = torch.stack([torch.randn(shape, generator=torch.Generator().manual_seed(s)) for s in req.init_seeds])
    latents_in = pack(x_t)

    def ours() -> torch.Tensor:
        cond = stage.encode_prompts(req.prompts, sp.guidance_scale, sp.max_sequence_length)
        return stage.diffuse(req, cond).at(sp.num_steps)

    def theirs() -> torch.Tensor:
        with torch.no_grad():
            out = pipe(
                prompt=PROMPTS, height=sp.height, width=sp.width, num_inference_steps=sp.num_steps,
                latents=latents_in.clone(), max_sequence_length=sp.max_sequence_length,
                output_type="latent", **kwargs,
            )  # fmt: skip
        images = out.frames if hasattr(out, "frames") else out.images
        return images if images.shape == x_t.shape else unpack(images, *shape[1:])

    a_out, b_out = ours(), theirs()  # warm-up pair
    max_abs_diff = (a_out - b_out).abs().max().item()
    if profile:
        import cProfile
        import pstats

        for name, fn in (("stage", ours), ("pipeline", theirs)):
            prof = cProfile.Profile()
            prof.enable()
            fn()
            prof.disable()
            print(f"--- {family} {name}: cProfile, top 15 by cumulative time", file=sys.stderr)
            pstats.Stats(prof, stream=sys.stderr).sort_stats("cumulative").print_stats(15)
    a_s, b_s, loads = [], [], []
    for _ in range(repeats):
        for fn, acc in ((ours, a_s), (theirs, b_s)):
            t0 = time.perf_counter()
            fn()
            acc.append(time.perf_counter() - t0)
        loads.append(load1())
    ratios = [a / b for a, b in zip(a_s, b_s, strict=True)]
    return {
        "part": "overhead",
        "family": family,
        "stage_class": type(stage).__name__,
        "pipeline_class": type(pipe).__name__,
        "ode_steps": ode_steps,
        "batch": len(req),
        "latent_shape": list(shape),
        "guidance_scale": sp.guidance_scale,
        "threads": threads,
        "stage_median_s": statistics.median(a_s),
        "pipeline_median_s": statistics.median(b_s),
        "ratio_median": statistics.median(ratios),
        "ratio_min": min(ratios),
        "ratio_max": max(ratios),
        "ratio_of_minima": min(a_s) / min(b_s),
        "stage_s": a_s,
        "pipeline_s": b_s,
        "max_abs_diff": max_abs_diff,
        "load1": loads,
        "goal_ratio": 1.05,
    }


def tables(rows: list[dict]) -> str:
    out = []
    train = [r for r in rows if r["part"] == "train"]
    if train:
        out += [
            "| family | recipe | steps | rollout s | train s | step s | fastest step s | peak RSS MB "
            "| load (1 min) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        out += [
            f"| {r['family']} | `{r['recipe']}` | {r['steps']} | {r['rollout_s']:.2f} | {r['train_s']:.2f} "
            f"| {r['step_s']:.2f} | {min(r['step_s_per_step'][1:]):.2f} | {r['peak_rss_mb']:.0f} "
            f"| {r['load1_before']:.1f} -> {r['load1_after']:.1f} |"
            for r in train
        ]
    ov = [r for r in rows if r["part"] == "overhead"]
    if ov:
        out += [
            "",
            "| family | batch x latent | ODE steps | stage median s | pipeline median s "
            "| ratio median (min-max) | ratio of minima | max abs diff | load (1 min) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        out += [
            f"| {r['family']} | {r['batch']} x {r['latent_shape']} | {r['ode_steps']} | {r['stage_median_s']:.3f} "
            f"| {r['pipeline_median_s']:.3f} | {r['ratio_median']:.3f} ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) "
            f"| {r['ratio_of_minima']:.3f} | {r['max_abs_diff']:.1e} | {min(r['load1']):.1f}-{max(r['load1']):.1f} |"
            for r in ov
        ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--part", choices=["train", "overhead", "both"], default="both")
    ap.add_argument("--only", default="", help="comma-separated subset of: " + ",".join(FAMILIES))
    ap.add_argument("--train-steps", type=int, default=3)
    ap.add_argument("--ode-steps", type=int, default=10)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--profile", action="store_true", help="cProfile one call of each side (to stderr)")
    ap.add_argument("--out", default=os.path.join(RESULTS, "model_families.jsonl"))
    ap.add_argument("--workdir", default=None, help="recipe run outputs (default: a temporary directory)")
    args = ap.parse_args()
    names = [n for n in args.only.split(",") if n] or list(FAMILIES)
    unknown = [n for n in names if n not in FAMILIES]
    if unknown:
        ap.error(f"--only: unknown family(ies) {unknown}; known: {sorted(FAMILIES)}")
    if args.train_steps < 2 or args.repeats < 1:
        ap.error("--train-steps must be >= 2 (the first is a warm-up) and --repeats >= 1")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    rows: list[dict] = []
    if args.part in ("overhead", "both"):
        import torch
        from diffusers.utils import logging as diffusers_logging
        from transformers.utils import logging as transformers_logging

        torch.set_num_threads(args.threads)
        diffusers_logging.set_verbosity_error()  # the pipelines' CLIP truncation notices
        transformers_logging.set_verbosity_error()
        for name in names:
            try:
                rows.append(overhead(name, args.ode_steps, args.repeats, args.threads, args.profile))
            except Exception as exc:  # a family that fails to build is reported, the others still run
                print(f"{name}: overhead failed: {type(exc).__name__}: {exc}", file=sys.stderr)
                continue
            with open(args.out, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
            print(json.dumps({k: v for k, v in rows[-1].items() if not isinstance(v, list)}), flush=True)
    if args.part in ("train", "both"):
        workdir = args.workdir or tempfile.mkdtemp(prefix="unirl_model_families_")
        os.makedirs(workdir, exist_ok=True)
        for name in names:
            try:
                rows.append(run_recipe(name, args.train_steps, args.threads, workdir))
            except RuntimeError as exc:
                print(str(exc), file=sys.stderr)
                continue
            with open(args.out, "a") as f:
                f.write(json.dumps(rows[-1]) + "\n")
            print(json.dumps({k: v for k, v in rows[-1].items() if not isinstance(v, list)}), flush=True)
    print(tables(rows))
    if not rows:
        sys.exit("no family produced a figure")


if __name__ == "__main__":
    main()
