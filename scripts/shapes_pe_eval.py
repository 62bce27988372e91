"""Rewrite accuracy of a shapes prompt enhancer (PE) on every slice of the PE world.

For each slice (the RL-form training prompts "train", and "heldout", "unseen_templates",
"unseen_words"; `worlds.shapes.ShapesPEDataset`): greedy and pass@k at a temperature, scored by
`RewriteMatchesScene` through the same requests as `LMEvaluator` (`unirl.trainer.text_eval`),
overall, per category and per forms tier; and the floor, the fraction of raw user prompts that
already parse (`parse_prompt`) and that parse to the right scene (what feeding the raw prompt to
the diffusion base gets; the prompt without its final `END`). Writes a JSON file and prints a table.

    python scripts/shapes_pe_eval.py --model checkpoints/shapes_pe --out checkpoints/shapes_pe/rewrite_accuracy.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from unirl.models.causal_lm import CausalLMStage
from unirl.models.qwen import QwenConfig
from unirl.rollout.trainside import TrainsideEngine
from unirl.trainer.text_eval import TextEvalSampling, eval_requests, text_accuracies
from worlds.shapes import RewriteMatchesScene, ShapesPEDataset, parse_prompt, same_scene
from worlds.shapes.paraphrase import END, RL_SHARE

SLICES = (("train", "train"), ("eval", "heldout"), ("eval", "unseen_templates"), ("eval", "unseen_words"))


def floor(examples: list) -> dict[str, float]:
    """Fractions of raw prompts that parse, and that parse to their scene."""
    parses = right = 0
    for ex in examples:
        try:
            spec = parse_prompt(ex.prompt.removesuffix(END))
        except ValueError:
            continue
        parses += 1
        right += same_scene(spec, parse_prompt(ex.metadata["canonical"]))
    return {"raw_parses": parses / len(examples), "raw_right": right / len(examples)}


@torch.no_grad()
def evaluate(model: str, seed: int, per_scene: int, sampling: TextEvalSampling, rl_share: float) -> dict:
    """{slice: {"prompts", accuracies (text_eval keys), floor, "examples": a few greedy rewrites}}."""
    bundle = QwenConfig(pretrained_path=model).build()
    engine = TrainsideEngine(CausalLMStage(bundle), sampling.forward_batch_size)
    scorer = RewriteMatchesScene()
    out = {}
    for split, name in SLICES:
        examples = ShapesPEDataset(
            split, slice=name, seed=seed, per_scene=per_scene, rl_share=rl_share
        ).examples
        reqs = eval_requests(examples, sampling)
        texts = {k: engine.generate(req).track(engine.track_name).texts for k, req in reqs.items()}
        row = {
            "prompts": len(examples),
            **text_accuracies(reqs, texts, examples, scorer, sampling),
            **floor(examples),
        }
        row["examples"] = [
            [ex.prompt, t, ex.metadata["canonical"]]
            for ex, t in zip(examples[::41], texts["greedy"][::41], strict=True)
        ]
        out[name] = row
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="checkpoints/shapes_pe")
    parser.add_argument("--out", default=None, help="JSON file to write")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--per-scene", type=int, default=4)
    parser.add_argument("--pass-k", type=int, default=16)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--rl-share", type=float, default=RL_SHARE)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    sampling = TextEvalSampling(
        max_new_tokens=48,
        temperature=args.temperature,
        pass_k=args.pass_k,
        max_prompt_length=96,
        group_by=["category", "forms"],
        forward_batch_size=512,
    )
    start = time.time()
    result = evaluate(args.model, args.seed, args.per_scene, sampling, args.rl_share)
    k = args.pass_k
    print(f"{'slice':18} {'n':>5} {'greedy':>7} {'pass@1':>7} {'pass@' + str(k):>8} {'raw parses':>11}")
    for name, row in result.items():
        print(
            f"{name:18} {row['prompts']:5d} {row['accuracy/greedy']:7.3f} {row['accuracy/pass@1']:7.3f} "
            f"{row[f'accuracy/pass@{k}']:8.3f} {row['raw_parses']:11.3f}"
        )
    meta = {
        "model": args.model,
        "seed": args.seed,
        "per_scene": args.per_scene,
        "pass_k": k,
        "temperature": args.temperature,
        "rl_share": args.rl_share,
        "seconds": round(time.time() - start, 1),
    }
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"settings": meta, "slices": result}, f, indent=1, sort_keys=True)
            f.write("\n")


if __name__ == "__main__":
    main()
