"""Pretrain the autoregressive half of a tiny Janus on the shapes world and save the model directory.

The second half of the shapes Janus base (issue 27, item 5; the first is `janus_vq_base.py`,
whose VQ-VAE this reuses frozen). Each training row is what a unified rollout produces, in the
same tokens (`CausalLMStage` prompt ids, then `VQImageStage.image_context`):

    user prompt (a PE-world paraphrase in SFT forms, `ShapesPESFTSource`)
    + plan (the scene's canonical prompt + `<end_of_plan>`) + `<begin_of_image>`
    + the VQ codes of a fresh render of the scene (row-major, `num_image_tokens`)

and the loss is the plan's cross-entropy (text head) plus the image tokens' (generation head).
A fraction `--uncond` of rows replace the context by its unconditional twin (pad everywhere but
BOI, `VQImageStage.unconditional`) and train the image tokens only, so classifier-free
guidance has an unconditional model to push away from. The plan learns the SFT forms only: the
RL-only synonyms and templates (`ShapesPEDataset`'s RL prompts) are left for BiCoT-GRPO's plan
track, as the shapes PE base leaves them.

    python scripts/janus_ar_base.py --vq outputs/janus_shapes/vq --out outputs/janus_shapes/ar \
        --steps 5000 --fp16 --tiny '{"hidden_size": 128, "num_layers": 4, ...}'

(`checkpoints/shapes_janus/TRAINING.md` has the full command that made the committed base.)

The VQ fields of `--tiny` (num_patches, codebook_size, vq_levels, vq_channels, vq_embed_dim)
must be the VQ directory's. Every `--eval_every` steps (and at the end) it prints and logs to
`ar_log.jsonl`: plan exact match (greedy, held-out scenes in SFT forms) and GenEvalMini strict
of images drawn after the correct plan (CFG `--cfg`, temperature 1, seeded) on held-out scenes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import time

import numpy as np
import torch

from unirl.models.image_tokens import VQImageStage
from unirl.models.janus import JanusModelConfig, TinyJanusConfig
from unirl.models.janus.config import PLAN_END_TOKEN
from unirl.models.janus.pretrain import nearest_codes, pixels, plan_ids, teacher_forced_losses
from unirl.types.sampling import ImageTokenSamplingParams
from worlds.shapes import GenEvalMini, ShapesPESFTSource
from worlds.shapes.paraphrase import paraphrase
from worlds.shapes.world import parse_prompt, render, split_scenes

_VQ_FIELDS = ("num_patches", "codebook_size", "vq_levels", "vq_channels", "vq_embed_dim")


def build(vq_dir: str, tiny: dict):
    """A tiny Janus of config `tiny` carrying the VQ-VAE of `vq_dir` (geometry checked)."""
    vq_bundle = JanusModelConfig(pretrained_path=vq_dir).build()
    bundle = JanusModelConfig(tiny=TinyJanusConfig(**tiny)).build()
    if (vq_bundle.num_image_tokens, vq_bundle.codebook_size, vq_bundle.image_size) != (
        bundle.num_image_tokens, bundle.codebook_size, bundle.image_size,
    ):  # fmt: skip
        raise ValueError(f"--tiny's VQ fields {_VQ_FIELDS} must match the VQ directory {vq_dir!r}")
    bundle.model.model.vqmodel.load_state_dict(vq_bundle.model.model.vqmodel.state_dict())
    return bundle


def codes_of(bundle, renders: np.ndarray) -> torch.Tensor:
    """[B, N] image tokens of uint8 renders [B, S, S, 3] (the frozen VQ's nearest codes)."""
    with torch.no_grad():
        return nearest_codes(bundle.model.model.vqmodel, pixels(renders))


def prompt_ids(bundle, text: str) -> torch.Tensor:
    """[P] a prompt's ids as `CausalLMStage` tokenizes it (`chat_template: false`)."""
    return torch.tensor(bundle.tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.long)


@torch.no_grad()
def greedy_plans(bundle, prompts: list[str], max_new: int = 48) -> list[str]:
    """Greedy plans (no cache; stops at `<end_of_plan>`), decoded without it."""
    tok = bundle.tokenizer
    stop = tok.convert_tokens_to_ids(PLAN_END_TOKEN)
    out = []
    for prompt in prompts:
        ids = prompt_ids(bundle, prompt).tolist()
        gen: list[int] = []
        for _ in range(max_new):
            logits = bundle.model(input_ids=torch.tensor([ids + gen])).logits[0, -1]
            nxt = int(logits.argmax())
            if nxt == stop:
                break
            gen.append(nxt)
        out.append(tok.decode(gen))
    return out


@torch.no_grad()
def evaluate(bundle, stage: VQImageStage, cfg: float, n: int = 64) -> dict[str, float]:
    """Plan exact match on held-out scenes (SFT forms, greedy) and GenEvalMini of images drawn
    after the correct plan on held-out scenes (seeded, temperature 1, CFG `cfg`)."""
    bundle.model.eval()
    rng = np.random.default_rng(7)
    py = random.Random(7)
    scenes = split_scenes(0)[1]
    picks = [scenes[int(i)] for i in rng.integers(0, len(scenes), n)]
    pairs = [paraphrase(s, py, rl_share=0.0) for s in picks]
    prompts = [t for t, _ in pairs]
    canon = [m["canonical"] for _, m in pairs]
    plans = greedy_plans(bundle, prompts[:32])
    plan_acc = float(np.mean([p.strip() == c for p, c in zip(plans, canon[:32], strict=True)]))
    contexts = [
        stage.image_context(prompt_ids(bundle, p), plan_ids(bundle, c))
        for p, c in zip(prompts, canon, strict=True)
    ]
    sampling = ImageTokenSamplingParams(temperature=1.0, guidance_scale=cfg, seed=0)
    media = torch.cat(
        [stage.generate(contexts[k : k + 32], list(range(k, k + 32)), sampling)[1] for k in range(0, n, 32)]
    )
    scores = GenEvalMini().evaluate(media, canon)
    bundle.model.train()
    return {
        "plan_exact": plan_acc,
        "image_strict": scores["accuracy_strict_samples"],
        "image_dense": scores["dense"],
        "color": scores.get("color", 0.0),
        "shape": scores.get("shape", 0.0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vq", required=True, help="the janus_vq_base.py output directory")
    parser.add_argument("--out", required=True)
    parser.add_argument("--tiny", required=True, help="TinyJanusConfig keys as JSON (VQ fields as the VQ's)")
    parser.add_argument("--steps", type=int, default=4000)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--uncond", type=float, default=0.1, help="share of rows trained unconditionally")
    parser.add_argument("--cfg", type=float, default=5.0, help="guidance scale of the evaluation's images")
    parser.add_argument("--eval_every", type=int, default=500)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--fp16", action="store_true", help="save the weights in fp16 (loaded back as fp32)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    tiny = json.loads(args.tiny)
    bundle = build(args.vq, tiny)
    model, vq = bundle.model, bundle.model.model.vqmodel
    # the VQ-VAE (frozen: its codes are the targets) and the unused understanding tower
    for name in bundle.frozen_modules:
        getattr(model.model, name).requires_grad_(False)
    vq.eval()
    stage = VQImageStage(bundle)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.0)

    def lr_at(step: int) -> float:  # linear warm-up, then cosine to 0
        if step < args.warmup:
            return (step + 1) / args.warmup
        return 0.5 * (1 + np.cos(np.pi * (step - args.warmup) / max(1, args.steps - args.warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_at)
    source, rng = ShapesPESFTSource(seed=0), np.random.default_rng(args.seed)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "ar_args.json"), "w") as f:
        json.dump({**vars(args), "tiny": dataclasses.asdict(TinyJanusConfig(**tiny))}, f, indent=1)
    log = open(os.path.join(args.out, "ar_log.jsonl"), "w")
    model.train()
    vq.eval()
    t0, window = time.perf_counter(), []
    for step in range(1, args.steps + 1):
        pairs = source.sample_batch(args.batch, rng)
        renders = np.stack([render(parse_prompt(c), rng, bundle.image_size) for _, c in pairs])
        uncond = [bool(u) for u in rng.random(args.batch) < args.uncond]
        plan_ce, image_ce = teacher_forced_losses(
            stage, [prompt_ids(bundle, t) for t, _ in pairs], [plan_ids(bundle, c) for _, c in pairs],
            codes_of(bundle, renders), uncond,
        )  # fmt: skip
        loss = plan_ce + image_ce
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        window.append((plan_ce.item(), image_ce.item()))
        if step % 50 == 0 or step == args.steps:
            row = {
                "step": step,
                "plan_ce": float(np.mean([w[0] for w in window])),
                "image_ce": float(np.mean([w[1] for w in window])),
                "lr": sched.get_last_lr()[0],
                "seconds": round(time.perf_counter() - t0, 1),
            }
            window = []
            if step == args.steps or step % args.eval_every == 0:
                row.update(evaluate(bundle, stage, args.cfg))
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")
            log.flush()
    log.close()
    model.eval()
    if args.fp16:
        model.half()
    bundle.save_pretrained(args.out)


if __name__ == "__main__":
    main()
