"""OCR accuracy of a text-drawing model on every slice of the OCR world, under the evaluation
sampler (Euler ODE) and under the rollout sampler (the RL recipe's SDE), with pass@k: how much
headroom RL has (pass@k well above pass@1) and what a run changed.

    python scripts/ocr_slices.py [--model checkpoints/ocr_sd3] [--checkpoint RUN/checkpoints/final]
        [--prompts 64] [--k 8] [--splits train,heldout,heldout_length] [--json out.json]

`--checkpoint`: a UniRL checkpoint directory (an RL run's `checkpoints/final`), loaded over its
base by `SD3ModelConfig.load_checkpoint`; without it the base model is measured. For each slice
(`train`, `heldout`, `heldout_length`; `--prompts` words each, a seeded subset) and each sampler,
k samples per word (seeds fixed, so two models are compared on the same noise):
    acc      mean exact-read rate over the k samples (pass@1)
    pass@k   fraction of words read exactly in at least one of the k samples
    ocr      mean OCR reward
The ODE sampler is the RL recipe's evaluation (20 Euler steps, CFG 3); the SDE sampler its
rollouts (10 steps, eta 0.7, CFG 3).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import replace

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from unirl.models.flow.stage import FlowMatchingStage  # noqa: E402
from unirl.models.sd3 import SD3ModelConfig  # noqa: E402
from unirl.rollout.trainside import TrainsideEngine  # noqa: E402
from unirl.sde.schedules import sigmas_for  # noqa: E402
from unirl.types import DiffusionSamplingParams  # noqa: E402
from unirl.types.rollout_req import RolloutReq  # noqa: E402
from worlds.ocr import SPLITS, OCRAccuracy, OCRWords  # noqa: E402

EVALUATED = ("train", "heldout", "heldout_length")  # length_rl is RL's prompts, never evaluated
SAMPLERS = {
    "ode": dict(num_steps=20, eta=0.0, sde_scheduler="all", ode_solver="euler"),
    "sde": dict(num_steps=10, eta=0.7, sde_scheduler="all"),
}


def measure(stage, examples, k: int, sampler: str, seed: int) -> dict[str, float]:
    base = DiffusionSamplingParams(
        height=32,
        width=64,
        shift=1.0,
        max_sequence_length=16,
        guidance_scale=3.0,
        samples_per_prompt=k,
        seed=seed,
    )
    sp = replace(base, **SAMPLERS[sampler])
    info = stage.model_info()
    cell = info["vae_scale_factor"] * info["patch_size"]
    req = RolloutReq.from_prompts(examples, sp, sigmas_for(sp, (32 // cell) * (64 // cell)), rollout_id=0)
    track = TrainsideEngine(stage, 64).generate(req).track("diffusion")
    scores = OCRAccuracy().scores(track.media, track.prompts).view(len(examples), k)
    exact = (scores == 1.0).float()
    return {
        "acc": float(exact.mean()),
        f"pass@{k}": float(exact.max(dim=1).values.mean()),
        "ocr": float(scores.mean()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="checkpoints/ocr_sd3")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--k", type=int, default=8)
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--samplers", default="ode,sde")
    parser.add_argument(
        "--splits",
        default=",".join(EVALUATED),
        help=f"a comma list of {SPLITS} (default: the evaluated ones)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    config = SD3ModelConfig(pretrained_path=args.model)
    bundle = config.load_checkpoint(args.checkpoint) if args.checkpoint else config.build()
    stage = FlowMatchingStage(bundle)
    rows = {}
    with torch.no_grad():
        for split in args.splits.split(","):
            examples = OCRWords(split, limit=args.prompts).examples
            for sampler in args.samplers.split(","):
                started = time.perf_counter()
                rows[f"{split}/{sampler}"] = measure(stage, examples, args.k, sampler, args.seed)
                print(
                    f"{split:15s} {sampler}: "
                    + "  ".join(f"{k} {v:.3f}" for k, v in rows[f"{split}/{sampler}"].items())
                    + f"  ({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"model": args.model, "checkpoint": args.checkpoint, "k": args.k, "rows": rows}, f, indent=1
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
