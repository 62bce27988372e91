"""The trusted-peer check of the PE world: TRL's GRPOTrainer on the same PE, prompts and reward.

Runs TRL's GRPO on `checkpoints/shapes_pe` with the exact text reward (`RewriteMatchesScene`)
over `ShapesPEDataset(split="train")`, at the settings of `examples/pe/shapes_pe_text_grpo.yaml`
(8 prompts x 8 completions per step, temperature 1, 48 new tokens, token-level loss, group
std scaling, no KL, AdamW at a constant LR, one update per batch), then scores greedy rewrites of
the held-out slice the way the UniRL recipe's evaluation does. It answers one question: does the
peer lift this PE where UniRL's GRPO does not? (docs/results/shapes_pe.md)

TRL is not a UniRL dependency: install it beside the project (`pip install trl datasets`) or
put a target directory holding it on PYTHONPATH.

    python scripts/trl_pe_peer.py --steps 40 --lr 3e-4 --out outputs/trl_pe_peer
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="checkpoints/shapes_pe")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--beta", type=float, default=0.0, help="TRL's KL coefficient")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--prompts", type=int, default=8, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="completions per prompt")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="outputs/trl_pe_peer")
    args = ap.parse_args()
    try:
        import pyarrow as pa
        from trl import GRPOConfig, GRPOTrainer

        from datasets import Dataset
    except ImportError as e:
        raise SystemExit(f"trl_pe_peer.py needs TRL and datasets ({e}); pip install trl datasets") from e
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from unirl.types.reward import RewardRequest
    from worlds.shapes import RewriteMatchesScene, ShapesPEDataset

    torch.set_num_threads(1)
    scorer = RewriteMatchesScene()

    def score(texts: list[str], canonicals: list[str]) -> list[float]:
        req = RewardRequest(
            sample_ids=[str(i) for i in range(len(texts))],
            prompts=[""] * len(texts),
            texts=texts,
            metadata=[{"canonical": c} for c in canonicals],
        )
        return scorer(req).tolist()

    def reward_func(prompts, completions, canonical, **_):
        return score(list(completions), list(canonical))

    train = [ex for ex in ShapesPEDataset(split="train", seed=0, per_scene=4)]
    rows = [{"prompt": ex.prompt, "canonical": ex.metadata["canonical"]} for ex in train]
    # a fixed fingerprint: datasets' hashing of the table fails with some dill / pyarrow pairs
    data = Dataset(pa.Table.from_pylist(rows), fingerprint="shapes_pe_train")
    tok = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, torch_dtype=torch.float32)
    cfg = GRPOConfig(
        output_dir=args.out,
        max_steps=args.steps,
        per_device_train_batch_size=args.prompts * args.group,
        num_generations=args.group,
        max_completion_length=48,
        temperature=args.temperature,
        learning_rate=args.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        beta=args.beta,
        epsilon=0.2,
        loss_type="dapo",
        scale_rewards="group",
        num_iterations=1,
        use_cpu=True,
        bf16=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        seed=args.seed,
        disable_tqdm=True,
    )
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward_func, args=cfg, train_dataset=data, processing_class=tok
    )
    t0 = time.time()
    trainer.train()
    train_s = time.time() - t0

    def greedy_accuracy(split_slice: str) -> float:
        rows = list(ShapesPEDataset(split="eval", slice=split_slice, seed=0, per_scene=1))
        enc = tok([r.prompt for r in rows], add_special_tokens=False)["input_ids"]
        texts = []
        model.eval()
        with torch.no_grad():
            for ids in enc:
                out = model.generate(
                    torch.tensor([ids]),
                    max_new_tokens=48,
                    do_sample=False,
                    eos_token_id=tok.eos_token_id,
                    pad_token_id=tok.pad_token_id,
                )
                texts.append(tok.decode(out[0, len(ids) :], skip_special_tokens=True))
        return sum(score(texts, [r.metadata["canonical"] for r in rows])) / len(rows)

    history = [
        {k: v for k, v in row.items() if isinstance(v, (int, float))} for row in trainer.state.log_history
    ]
    result = {
        "settings": vars(args),
        "train_seconds": round(train_s, 1),
        "heldout_greedy": greedy_accuracy("heldout"),
        "unseen_templates_greedy": greedy_accuracy("unseen_templates"),
        "rewards": [row.get("reward") for row in history if "reward" in row],
    }
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "result.json"), "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items() if k != "rewards"}))


if __name__ == "__main__":
    main()
