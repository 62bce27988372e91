"""Score a model with a recipe's `eval` block and print the numbers as JSON.

    python -m unirl.evaluate --recipe diffusion/shapes_flowgrpo [--checkpoint DIR] [key=value ...]
    python -m unirl.evaluate --recipe llm/arith_grpo [--checkpoint DIR] [key=value ...]

A diffusion recipe scores images (`BundleEvaluator`), a text recipe greedy exact match and
pass@k (`unirl.trainer.text_eval.LMEvaluator`), by the modality of the recipe's model.

Without `--checkpoint` it scores the recipe's model as built (the pretrained
base); with it, the weights of a UniRL checkpoint (`checkpoints/final`, or a
step checkpoint's `weights/`). Sampling is deterministic, so the numbers equal
the run's `eval/...` metrics for the same weights (up to data-parallel batching).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from hydra import compose, initialize_config_dir

EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", required=True, help="recipe name, e.g. diffusion/shapes_flowgrpo")
    parser.add_argument("--checkpoint", help="a UniRL checkpoint directory (with unirl_checkpoint.json)")
    parser.add_argument("overrides", nargs="*", help="Hydra key=value overrides of the recipe")
    args = parser.parse_args(argv)
    with initialize_config_dir(config_dir=EXAMPLES, version_base=None):
        cfg = compose(args.recipe, overrides=args.overrides)
    if cfg.get("eval") is None:
        print(f"error: recipe {args.recipe} has no `eval` block to score with", file=sys.stderr)
        return 2
    from unirl.distributed.cores import govern_threads
    from unirl.trainer.worker import build, quiet_library_logs

    quiet_library_logs()
    govern_threads()
    if args.checkpoint and not os.path.isfile(os.path.join(args.checkpoint, "unirl_checkpoint.json")):
        print(f"error: --checkpoint {args.checkpoint} has no unirl_checkpoint.json", file=sys.stderr)
        return 2
    model, ev = build(cfg.model), cfg.eval
    if model.modality == "text":
        from unirl.trainer.text_eval import LMEvaluator

        evaluator = LMEvaluator(build(ev.examples), build(ev.scorer), build(ev.sampling))
    else:
        from unirl.trainer.evaluation import BundleEvaluator

        evaluator = BundleEvaluator(build(ev.examples), build(cfg.sampling), build(ev.scorer), build(ev.sampling))
    bundle = model.load_checkpoint(args.checkpoint) if args.checkpoint else model.build()
    result = {f"eval/{k}": v for k, v in evaluator(bundle).items()}
    result["checkpoint"] = args.checkpoint
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
