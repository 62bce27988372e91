"""Generation throughput: the vLLM engine inside UniRL against the trainer's own `generate` (issue 43).

For each model, one process builds the same weights twice: a `CausalLMStage` sampled through
`TrainsideEngine` (our KV-cached generate loop, what a trainside rollout runs) and a `VLLMEngine`
fed those weights by `weights_loaded` (what a dedicated vLLM engine runs after a sync, the probe
included). Both sample the same request (prompts x samples, temperature 1, per-sample seeds, EOS
ends a response), warm (one untimed request first), `--repeats` times alternately; the median
wall time of each and the response tokens it produced give tokens/s, and the ratio vLLM / ours
is reported side by side from the same run.

Models:
- `arith_lm`: the committed base `checkpoints/arith_lm` (3.3M parameters), its problems as
  prompts, 8 new tokens;
- `qwen3_25m`: a random Qwen3 of about 25M parameters (hidden 512, 8 layers, 8 heads of 64),
  16 prompts, 128 new tokens;
- `qwen3_25m_lora` (`measure_lora`): that model with a rank-16 LoRA on every block linear, served
  merged (W + s B A pushed at every sync) and as a vLLM LoRA adapter: push time and tokens/s.

    python benchmarks/vllm_generation.py [--models arith_lm qwen3_25m qwen3_25m_lora] [--repeats 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

DEFAULT_OUT = os.path.join(REPO, "benchmarks", "results", "vllm_generation.jsonl")
TARGETS = {"qwen3_25m": 1.25, "arith_lm": 1 / 1.3}  # vLLM / ours, tokens/s: at least these


def models() -> dict:
    from unirl.models.causal_lm import TinyLMConfig
    from unirl.models.qwen import QwenConfig

    return {
        "arith_lm": (QwenConfig(pretrained_path=os.path.join(REPO, "checkpoints", "arith_lm")), 8, False),
        "qwen3_25m": (
            QwenConfig(
                tiny=TinyLMConfig(
                    hidden_size=512,
                    num_layers=8,
                    num_attention_heads=8,
                    num_key_value_heads=4,
                    intermediate_size=1536,
                    max_position_embeddings=256,
                )
            ),
            128,
            True,
        ),
    }


def request(name: str, max_new_tokens: int, chat: bool, prompts: int, samples: int):
    from unirl.types.rollout_req import PromptExample, RolloutReq
    from unirl.types.sampling import TextSamplingParams

    if name == "arith_lm":
        from worlds.arith import ArithDataset

        rows = ArithDataset(split="train", seed=0)
        texts = [rows[i].prompt for i in range(prompts)]
    else:
        texts = [f"Question {i}: what comes after {i}?" for i in range(prompts)]
    sp = TextSamplingParams(
        samples_per_prompt=samples, max_new_tokens=max_new_tokens, chat_template=chat, max_prompt_length=64
    )
    return RolloutReq.from_prompts([PromptExample(t, f"p{i}") for i, t in enumerate(texts)], sp, None, 0)


def timed(engine, req) -> tuple[float, int]:
    start = time.perf_counter()
    track = engine.generate(req).track("text")
    return time.perf_counter() - start, int(track.segment.response_lengths.sum())


def measure(name: str, repeats: int, prompts: int, samples: int) -> dict:
    import torch

    from unirl.models.causal_lm import CausalLMStage
    from unirl.rollout.trainside import TrainsideEngine
    from unirl.rollout.vllm import VLLMEngine

    cfg, new_tokens, chat = models()[name]
    ours = CausalLMStage(cfg.build())
    staged = CausalLMStage(cfg.build())
    with torch.no_grad():
        for a, b in zip(ours.module.parameters(), staged.module.parameters(), strict=True):
            b.copy_(a)
    start = time.perf_counter()
    engine = VLLMEngine(staged, forward_batch_size=None, sleep_level=0, kv_cache_mb=256)
    engine.weights_loaded(1)
    startup = time.perf_counter() - start
    trainside = TrainsideEngine(ours, None)
    req = request(name, new_tokens, chat, prompts, samples)
    timed(trainside, req), timed(engine, req)  # warm
    runs = {"ours": [], "vllm": []}
    for _ in range(repeats):
        runs["ours"].append(timed(trainside, req))
        runs["vllm"].append(timed(engine, req))
    engine.close()
    out = {
        "model": name,
        "params_m": round(sum(p.numel() for p in ours.module.parameters()) / 1e6, 2),
        "samples": len(req),
        "max_new_tokens": new_tokens,
        "threads": torch.get_num_threads(),
        "vllm_startup_s": round(startup, 2),
    }
    for side, rows in runs.items():
        secs = statistics.median(s for s, _ in rows)
        tokens = statistics.median(n for _, n in rows)
        out[f"{side}_s"], out[f"{side}_tokens"] = round(secs, 4), tokens
        out[f"{side}_tokens_per_s"] = round(tokens / secs, 1)
    out["vllm_over_ours"] = round(out["vllm_tokens_per_s"] / out["ours_tokens_per_s"], 3)
    out["target"] = round(TARGETS[name], 3)
    out["meets_target"] = out["vllm_over_ours"] >= TARGETS[name]
    return out


def measure_lora(repeats: int, prompts: int, samples: int, rank: int = 16, new_tokens: int = 64) -> dict:
    """The 25M Qwen3 with a rank-`rank` LoRA on every linear layer of its blocks, served by two
    vLLM engines: `lora_mode: merged` (W + s B A pushed at every sync) and `lora_mode: adapter`
    (the base pushed once, the adapter served by vLLM's LoRA kernels and rewritten at every
    sync). Per engine: the median push (`weights_loaded`, probe off) and tokens/s."""
    import torch

    from unirl.models.causal_lm import CausalLMStage
    from unirl.rollout.vllm import VLLMEngine
    from unirl.train.backend import LoRAConfig, inject_lora

    cfg, _, chat = models()["qwen3_25m"]
    lora = LoRAConfig(
        rank=rank,
        alpha=rank,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    )
    stages = []
    for _ in range(3):
        stage = CausalLMStage(cfg.build())
        inject_lora(stage.module, lora)
        stages.append(stage)
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for p in stages[0].module.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=gen))
        for other in stages[1:]:
            for a, b in zip(stages[0].module.parameters(), other.module.parameters(), strict=True):
                b.copy_(a)
    req = request("qwen3_25m", new_tokens, chat, prompts, samples)
    out = {"model": "qwen3_25m_lora", "lora_rank": rank, "samples": len(req), "max_new_tokens": new_tokens}
    for mode, stage in zip(("merged", "adapter"), stages[1:], strict=True):
        # one vLLM engine alive at a time: a second one in the process takes over vLLM's
        # process-wide parallel state (an engine actor holds one engine)
        engine = VLLMEngine(stage, sleep_level=0, kv_cache_mb=256, verify_sync=False, lora_mode=mode)
        pushes = []
        for version in range(1, repeats + 2):
            start = time.perf_counter()
            engine.weights_loaded(version)
            pushes.append(time.perf_counter() - start)
        timed(engine, req)  # warm
        runs = [timed(engine, req) for _ in range(repeats)]
        secs, tokens = statistics.median(s for s, _ in runs), statistics.median(n for _, n in runs)
        out[f"{mode}_push_s"] = round(
            statistics.median(pushes[1:]), 4
        )  # the first adapter push holds the base
        out[f"{mode}_first_push_s"] = round(pushes[0], 4)
        out[f"{mode}_tokens_per_s"] = round(tokens / secs, 1)
        engine.close()
    out["adapter_over_merged_tokens_per_s"] = round(
        out["adapter_tokens_per_s"] / out["merged_tokens_per_s"], 3
    )
    out["adapter_over_merged_push"] = round(out["adapter_push_s"] / out["merged_push_s"], 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["arith_lm", "qwen3_25m", "qwen3_25m_lora"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=8)
    parser.add_argument("--out", default=DEFAULT_OUT)
    args = parser.parse_args()
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    for name in args.models:
        if name == "qwen3_25m_lora":
            row = measure_lora(args.repeats, args.prompts, args.samples)
        else:
            row = measure(name, args.repeats, args.prompts, args.samples)
        print(json.dumps(row), flush=True)
        with open(args.out, "a") as f:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
