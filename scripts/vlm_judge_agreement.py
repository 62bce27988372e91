"""How often the VLM judge agrees with the weight-free scorer on held-out samples of the shapes base.

    python scripts/vlm_judge_agreement.py [--judge checkpoints/shapes_vqa] [--aggregate product]

Images: the committed held-out base samples `checkpoints/shapes_reward/heldout.npz` (ODE samples
of `checkpoints/shapes_sd3`: 256 of training prompts under unseen seeds, 204 of the held-out
prompts), which no judge trained on. Labels: `GenEvalMini` strict verdicts. Prints JSON: per set,
the AUC of the judge's score for the strict verdict, the agreement of the verdict "score > 0.5"
and of the best single threshold, the positive rate, and the strict agreement per category.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from unirl.models.qwen_vl import QwenVLConfig  # noqa: E402
from unirl.reward.judge import VLMJudge  # noqa: E402
from unirl.types.reward import RewardRequest  # noqa: E402
from worlds.shapes import GenEvalMini, parse_prompt  # noqa: E402
from worlds.shapes.train_reward_model import auc  # noqa: E402
from worlds.shapes.vqa import JudgeQuestions  # noqa: E402

HELDOUT = "checkpoints/shapes_reward/heldout.npz"


def agreement(scores: np.ndarray, labels: np.ndarray, categories: list[str]) -> dict:
    verdict = scores > 0.5
    thresholds = np.unique(np.concatenate([[0.0], scores]))
    best = max(float(((scores > t) == labels).mean()) for t in thresholds)
    out = {
        "n": len(scores),
        "positive_rate": float(labels.mean()),
        "auc": auc(scores, labels.astype(float)),
        "agreement@0.5": float((verdict == labels).mean()),
        "agreement@best_threshold": best,
    }
    for cat in sorted(set(categories)):
        m = np.array([c == cat for c in categories])
        out[f"agreement@0.5/{cat}"] = float((verdict[m] == labels[m]).mean())
        out[f"auc/{cat}"] = auc(scores[m], labels[m].astype(float))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--judge", default="checkpoints/shapes_vqa")
    parser.add_argument("--aggregate", default="product", choices=["product", "mean"])
    args = parser.parse_args()
    data = np.load(HELDOUT)
    judge = VLMJudge(QwenVLConfig(pretrained_path=args.judge), questions=JudgeQuestions(), aggregate=args.aggregate)
    result = {"judge": args.judge, "aggregate": args.aggregate}
    t0 = time.time()
    for name in ("heldout_train", "heldout_eval"):
        images = torch.from_numpy(data[f"{name}_images"]).permute(0, 3, 1, 2).contiguous()
        prompts = [str(p) for p in data[f"{name}_prompts"]]
        req = RewardRequest(
            sample_ids=[f"{name}/{i}" for i in range(len(prompts))], prompts=prompts, images=images
        )
        scores = judge(req).numpy()
        labels = GenEvalMini(mode="strict")(req).numpy() > 0.5
        result[name] = agreement(scores, labels, [parse_prompt(p).category for p in prompts])
    result["seconds"] = round(time.time() - t0, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
