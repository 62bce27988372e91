"""The editing world's headroom: how often an edit model gets an edit right in one try and in k.

Samples every row of a split `--samples` times as an RL recipe's rollouts sample (10 steps,
`--sde-steps` of them SDE steps at eta 0.7, one seed per sample: 4 as the figures of
docs/results/shapes_edit.md were measured, 9 as `diffusion/shapes_edit_flowgrpo` now samples;
`--eta 0`: the evaluation's ODE), scores each image with `ShapesEditScore`, and prints per kind:
the mean graded reward, strict accuracy (pass@1) and pass@k (a row counts when any of its k
samples is strictly right). pass@k over pass@1 is the room group-relative RL has: it can only
reinforce what some sample already does.

    python scripts/shapes_edit_headroom.py [--model checkpoints/shapes_edit] [--split eval] [--samples 8]
    [--checkpoint outputs/shapes_edit_flowgrpo/checkpoints/final]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unirl.models.flux import FluxKontextModelConfig, FluxStage  # noqa: E402
from unirl.rollout.trainside import TrainsideEngine  # noqa: E402
from unirl.sde.schedules import sigmas_for  # noqa: E402
from unirl.types import DiffusionSamplingParams, RolloutReq  # noqa: E402
from worlds.shapes.edit import EDIT_KINDS, ShapesEditDataset, ShapesEditScore  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/shapes_edit")
    ap.add_argument(
        "--checkpoint",
        default=None,
        help="a run's exported checkpoint (checkpoints/final), instead of --model",
    )
    ap.add_argument("--split", default="eval", choices=["train", "eval"])
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--rows", type=int, default=None, help="the recipe's data_source.rows pool (seed 0)")
    ap.add_argument("--eta", type=float, default=0.7, help="0: the evaluation's ODE")
    ap.add_argument("--sde-steps", type=int, default=4, help="how many of the 10 steps are SDE steps")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    config = FluxKontextModelConfig(pretrained_path=args.model, tiny=None)
    bundle = config.load_checkpoint(args.checkpoint) if args.checkpoint else config.build()
    examples = ShapesEditDataset(args.split, 0, shuffle=False, rows=args.rows).examples
    sp = DiffusionSamplingParams(
        num_steps=10,
        samples_per_prompt=args.samples,
        height=32,
        width=32,
        guidance_scale=1.0,
        eta=args.eta,
        shift=1.0,
        sigma_grid="steps",
        max_sequence_length=10,
        seed=args.seed,
        sde_scheduler="random",
        sde_num_steps=args.sde_steps,
        sde_window=(0.0, 0.99),
    )
    stage = FluxStage(bundle)
    req = RolloutReq.from_prompts(examples, sp, sigmas_for(sp, (32 // 2) ** 2), rollout_id=0)
    track = TrainsideEngine(stage, 64).generate(req).track("diffusion")
    results = ShapesEditScore().score_all(track.media, list(req.prompts), list(req.metadata))
    k = args.samples
    rows = [results[i * k : (i + 1) * k] for i in range(len(examples))]
    print(
        f"{args.model}{' + ' + args.checkpoint if args.checkpoint else ''}: {args.split} (pool {args.rows}), {len(rows)} rows x {k} samples, eta {args.eta}"
    )
    print(f"| kind | graded reward | strict (pass@1) | pass@{k} |")
    print("|---|---|---|---|")
    for kind in (*EDIT_KINDS, "all"):
        rs = [r for r in rows if kind == "all" or r[0]["kind"] == kind]
        graded = np.mean([s["graded"] for r in rs for s in r])
        strict = np.mean([s["strict"] for r in rs for s in r])
        passk = np.mean([max(s["strict"] for s in r) for r in rs])
        print(f"| {kind} | {graded:.3f} | {strict:.3f} | {passk:.3f} |")


if __name__ == "__main__":
    main()
