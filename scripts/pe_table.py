"""The shapes prompt-enhancer table from composed runs' metrics.jsonl: per evaluation slice, the
floor (user prompt fed straight to the image model), the start (the base PE), the ceiling (the
canonical prompt) and each run's held-out strict accuracy and greedy rewrite accuracy at every
evaluation.

    python scripts/pe_table.py outputs/shapes_pe_grpo [outputs/<control> ...]
"""

from __future__ import annotations

import json
import os
import sys

SLICES = ("heldout", "unseen_templates", "unseen_words")


def rows_of(run: str) -> list[dict]:
    with open(os.path.join(run, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main(runs: list[str]) -> None:
    first = rows_of(runs[0])[0]
    print("| slice | floor | start | ceiling |")
    print("|---|---|---|---|")
    for s in SLICES:
        key = f"accuracy_strict/slice={s}"
        print(
            f"| {s} | {first.get('eval/floor/' + key, float('nan')):.3f} | {first['eval/' + key]:.3f} "
            f"| {first.get('eval/ceiling/' + key, float('nan')):.3f} |"
        )
    for run in runs:
        rows = [r for r in rows_of(run) if "eval/accuracy_strict" in r]
        steps = [r for r in rows_of(run) if "time/step_s" in r]
        minutes = sum(r["time/step_s"] for r in steps) / 60
        print(f"\n{run}: {len(steps)} steps, {minutes:.1f} min of training steps (evaluation not counted)\n")
        print("| step | " + " | ".join(f"{s} strict | {s} rewrite" for s in SLICES) + " |")
        print("|---" * (1 + 2 * len(SLICES)) + "|")
        for r in rows:
            cells = [
                f"{r[f'eval/accuracy_strict/slice={s}']:.3f} | {r.get(f'eval/rewrite/accuracy/slice={s}', float('nan')):.3f}"
                for s in SLICES
            ]
            print(f"| {r['step']} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(sys.argv[1:])
