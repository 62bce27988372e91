"""Causal-LM stage throughput vs bare transformers loops doing the same model work.

One tiny random Qwen3 (`--hidden`, `--layers`; ~2.5M parameters by default) and
one batch of `--prompts` chat-templated prompts of different lengths. In one run,
`--rounds` times (after one warm-up round), side by side:

- **rollout**: `CausalLMStage.generate` vs `model.generate` (transformers'
  sampler, KV cache, left padding) with the same sampling (temperature,
  top-k, top-p, `--new-tokens`, EOS). Tokens/s = batch x decoding steps / s
  (every row is computed at every step in both, finished or not).
- **train**: `CausalLMStage.token_log_probs` + backward of the masked sum vs a
  bare right-padded forward of the same sequences, `log_softmax(logits / T)`
  gathered at the response tokens, the same backward. Tokens/s = real
  (unpadded) tokens / s.
- **padding share**: padded tokens / all tokens in the replay forward's batch.

Prints a table and one JSON line (appended to `--out`) with medians, every
round's numbers and the ratios stage / bare, the median over rounds of each
back-to-back pair's ratio (goals: rollout >= 0.9, train >= 0.95).

    python benchmarks/lm_throughput.py [--device cuda] [--rounds 5] [--prompts 16] [--new-tokens 64]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from unirl.models.causal_lm import CausalLMStage, TinyLMConfig  # noqa: E402
from unirl.models.qwen import QwenConfig
from unirl.types.rollout_req import PromptExample, RolloutReq  # noqa: E402
from unirl.types.sampling import TextSamplingParams  # noqa: E402
from unirl.types.segments import TokenSegment, pad_right  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "lm_throughput.jsonl")
WORDS = "name a colour then count to ten and say why the sky is blue in one short line".split()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn, device: torch.device):
    sync(device)
    t0 = time.perf_counter()
    out = fn()
    sync(device)
    return out, time.perf_counter() - t0


def bare_generate(stage: CausalLMStage, prompts: list[torch.Tensor], sp: TextSamplingParams) -> int:
    """transformers' `generate` on the left-padded batch; returns the decoding steps run."""
    tok, device = stage.tokenizer, stage.device
    ids = pad_right([p.flip(0) for p in prompts], tok.pad_token_id).flip(1).to(device)
    mask = pad_right([torch.ones_like(p).flip(0) for p in prompts], 0).flip(1).to(device)
    out = stage.module.generate(
        input_ids=ids,
        attention_mask=mask,
        do_sample=True,
        temperature=sp.temperature,
        top_k=sp.top_k,
        top_p=sp.top_p,
        max_new_tokens=sp.max_new_tokens,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    return out.shape[1] - ids.shape[1]


def bare_train(model: torch.nn.Module, seg: TokenSegment, pad_id: int) -> None:
    """Right-padded forward of prompt + response, log-probs of the response tokens, backward."""
    device = next(model.parameters()).device
    seqs = [torch.cat([p, r]).to(device) for p, r in zip(seg.prompt_ids, seg.response_ids, strict=True)]
    ids = pad_right(seqs, pad_id)
    mask = pad_right([torch.ones_like(s) for s in seqs], 0)
    logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
    logp = torch.log_softmax(logits / seg.temperature, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    target = torch.zeros_like(logp)
    for i, (p, r) in enumerate(zip(seg.prompt_ids, seg.response_ids, strict=True)):
        target[i, p.numel() - 1 : p.numel() - 1 + r.numel()] = 1
    (logp * target).sum().backward()


def stage_train(stage: CausalLMStage, seg: TokenSegment) -> None:
    (stage.token_log_probs(seg) * seg.response_mask().to(stage.device)).sum().backward()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--out", default=RESULTS)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)

    tiny = TinyLMConfig(
        hidden_size=args.hidden,
        num_layers=args.layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * args.hidden,
    )
    stage = CausalLMStage(QwenConfig(tiny=tiny).build().to(device))
    num_params = sum(p.numel() for p in stage.module.parameters())
    examples = [
        PromptExample(" ".join(WORDS[: 2 + (3 * i) % len(WORDS)]), f"p{i}") for i in range(args.prompts)
    ]
    sp = TextSamplingParams(
        samples_per_prompt=1,
        max_new_tokens=args.new_tokens,
        max_prompt_length=128,
        temperature=1.0,
        top_k=50,
        top_p=0.95,
    )
    prompts = stage.encode_prompts(RolloutReq.from_prompts(examples, sp, None, 0))
    b = len(prompts)

    rows: dict[str, list[float]] = {k: [] for k in ("stage_gen", "bare_gen", "stage_train", "bare_train")}
    pad_share = []
    for r in range(args.rounds + 1):  # round 0 warms up
        req = RolloutReq.from_prompts(examples, sp, None, rollout_id=r)
        # each pair runs back to back, in alternating order, so drift in machine load hits both
        first_stage = r % 2 == 0
        for side in ("stage", "bare") if first_stage else ("bare", "stage"):
            if side == "stage":
                (seg, _), t_sg = timed(lambda req=req: stage.generate(req), device)
            else:
                torch.manual_seed(r)
                steps_bare, t_bg = timed(lambda: bare_generate(stage, prompts, sp), device)
        steps_stage = max(int(x.numel()) for x in seg.response_ids)
        lengths = [p.numel() + x.numel() for p, x in zip(seg.prompt_ids, seg.response_ids, strict=True)]
        real = sum(lengths)
        for side in ("stage", "bare") if first_stage else ("bare", "stage"):
            stage.module.zero_grad(set_to_none=True)
            if side == "stage":
                _, t_st = timed(lambda seg=seg: stage_train(stage, seg), device)
            else:
                _, t_bt = timed(
                    lambda seg=seg: bare_train(stage.module, seg, stage.tokenizer.pad_token_id), device
                )
        if r == 0:
            continue
        rows["stage_gen"].append(b * steps_stage / t_sg)
        rows["bare_gen"].append(b * steps_bare / t_bg)
        rows["stage_train"].append(real / t_st)
        rows["bare_train"].append(real / t_bt)
        pad_share.append(1 - real / (b * max(lengths)))

    med = {k: statistics.median(v) for k, v in rows.items()}
    # the ratio of each back-to-back pair, medianed: robust to load that changes between rounds
    ratio = {
        key: statistics.median(
            s / b_ for s, b_ in zip(rows[f"stage_{key}"], rows[f"bare_{key}"], strict=True)
        )
        for key in ("gen", "train")
    }
    result = {
        "bench": "lm_throughput",
        "device": str(device),
        "threads": args.threads,
        "num_params": num_params,
        "prompts": b,
        "new_tokens": args.new_tokens,
        "rounds": args.rounds,
        "rollout_tokens_per_s": {"stage": med["stage_gen"], "bare": med["bare_gen"]},
        "rollout_ratio": ratio["gen"],
        "train_tokens_per_s": {"stage": med["stage_train"], "bare": med["bare_train"]},
        "train_ratio": ratio["train"],
        "replay_padding_share": statistics.median(pad_share),
        "per_round": rows,
    }
    print(f"tiny Qwen3, {num_params / 1e6:.2f}M params, {b} prompts x {args.new_tokens} new tokens, {device}")
    print(f"{'':10}{'stage tok/s':>14}{'bare tok/s':>14}{'ratio':>8}{'goal':>8}")
    for name, key, goal in (("rollout", "gen", 0.9), ("train", "train", 0.95)):
        print(f"{name:10}{med[f'stage_{key}']:14.0f}{med[f'bare_{key}']:14.0f}{ratio[key]:8.2f}{goal:8.2f}")
    print(f"replay padding share: {result['replay_padding_share']:.3f}")
    print(json.dumps(result))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
