"""The trusted peer of the vLLM engine: TRL's GRPOTrainer with `use_vllm=True` (colocate) on vLLM's CPU build.

Runs TRL 1.16's GRPO on `checkpoints/arith_lm` (arithmetic problems as prompts, 16 per step x 8
completions x 8 tokens, a digits reward) with vLLM colocated in the trainer process, as
`llm/arith_grpo_vllm` runs UniRL's. It answers whether TRL's vLLM path runs on the CPU build of
vLLM at all (docs/results/vllm.md: it does not; the first weight sync fails).

TRL is not a UniRL dependency: install it beside the project (`pip install trl datasets`).

    python scripts/trl_vllm_peer.py [--steps 3] [--out outputs/trl_vllm_peer]
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", default="outputs/trl_vllm_peer")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    try:
        from trl import GRPOConfig, GRPOTrainer

        from datasets import Dataset
    except ImportError as e:
        raise SystemExit(f"trl_vllm_peer.py needs TRL and datasets ({e}); pip install trl datasets") from e

    from worlds.arith import ArithDataset

    problems = ArithDataset(split="train", seed=0)
    rows = [{"prompt": problems[i].prompt} for i in range(64)]

    def digits(completions, **_):
        return [float(any(ch.isdigit() for ch in c)) for c in completions]

    config = GRPOConfig(
        output_dir=args.out,
        use_vllm=True,
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.3,  # on the CPU build: the share of host memory for the KV cache
        use_cpu=True,
        per_device_train_batch_size=16,
        num_generations=8,
        max_completion_length=8,
        max_steps=args.steps,
        learning_rate=1e-4,
        temperature=1.0,
        report_to=[],
        logging_steps=1,
        save_strategy="no",
    )
    start = time.perf_counter()
    trainer = GRPOTrainer(
        model="checkpoints/arith_lm", reward_funcs=digits, args=config, train_dataset=Dataset.from_list(rows)
    )
    print(f"built in {time.perf_counter() - start:.1f} s (vLLM started)", flush=True)
    trainer.train()
    print(json.dumps(trainer.state.log_history))


if __name__ == "__main__":
    main()
