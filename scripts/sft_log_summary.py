"""Print markdown tables summarising an `sft_log.jsonl` of the retired `unirl.train_sft` loop (the
logs committed beside the bases it made, `checkpoints/*/TRAINING.md`).

    python scripts/sft_log_summary.py RUN_DIR_OR_LOG [--every 500]

RUN_DIR_OR_LOG is a directory holding `sft_log.jsonl` or a log file itself
(e.g. `checkpoints/shapes_sd3/sft_log_stage2.jsonl`).

Loss table: the logged loss (mean over each logging window) and lr every
`--every` steps. Eval table: every row with `eval/...` keys (the per-category
held-out accuracies of `GenEvalMini`, or any other scorer's keys). This is how `checkpoints/*/TRAINING.md`
tables are made.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

EVAL_COLUMNS = [
    ("strict", "eval/accuracy_strict"),
    ("strict (samples)", "eval/accuracy_strict_samples"),
    ("two_objects", "eval/accuracy/two_objects"),
    ("counting", "eval/accuracy/counting"),
    ("position", "eval/accuracy/position"),
    ("colour", "eval/color"),
    ("shape", "eval/shape"),
    ("dense", "eval/dense"),
]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", help="a directory with sft_log.jsonl, or an sft_log .jsonl file")
    parser.add_argument("--every", type=int, default=500, help="loss rows every this many steps")
    args = parser.parse_args(argv)
    path = args.run_dir if os.path.isfile(args.run_dir) else os.path.join(args.run_dir, "sft_log.jsonl")
    if not os.path.isfile(path):
        print(
            f"error: {path} does not exist (is {args.run_dir} a directory with sft_log.jsonl, or such a log?)",
            file=sys.stderr,
        )
        return 2
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    losses = [r for r in rows if "loss" in r and (r["step"] % args.every == 0 or r is rows[-1])]
    print("| step | loss (logging window mean) | lr |\n|---:|---:|---:|")
    for r in losses:
        print(f"| {r['step']} | {r['loss']:.4f} | {r['lr']:.2e} |")
    evals = [r for r in rows if any(k.startswith("eval/") for k in r)]
    if evals:
        cols = [(name, key) for name, key in EVAL_COLUMNS if any(key in r for r in evals)]
        known = {key for _, key in EVAL_COLUMNS}  # other scorers' keys (e.g. the OCR world's): as they are named
        cols += [(k.removeprefix("eval/"), k) for k in sorted({k for r in evals for k in r}) if k.startswith("eval/") and k not in known]
        print("\n| step | " + " | ".join(name for name, _ in cols) + " |")
        print("|---:|" + "---:|" * len(cols))
        for r in evals:
            step = f"{r['step']} (final)" if r.get("final") else str(r["step"])
            cells = [f"{r[key]:.3f}" if key in r else "" for _, key in cols]
            print(f"| {step} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
