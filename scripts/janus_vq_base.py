"""Train the VQ tokenizer of a tiny Janus on the shapes renders and save the model directory.

The first half of a Janus-style shapes base (issue 27, item 5; `janus_ar_base.py` trains the
second on top of it): the VQ-VAE (encoder, codebook, decoder) learns to reconstruct the shapes
world's training renders (resized to the model's image size) through the normalised quantizer of
`unirl/models/janus/pretrain.py`, so its codes decode to colours and parts of shapes; the
backbone and both heads stay as initialised.

    python scripts/janus_vq_base.py --out outputs/janus_shapes/vq --steps 2000 --eval_every 250 \
        --tiny '{"num_patches": 8, "codebook_size": 256, "vq_levels": 3, "vq_embed_dim": 8, "max_position_embeddings": 256}'

(the tokenizer of `checkpoints/shapes_janus`). Prints one line per 50 steps (step,
reconstruction MSE, codes in use of the batch, seconds; at the end and every `--eval_every`
steps the GenEvalMini round trip of held-out renders through codes and the library's decode)
and writes `vq_log.jsonl` beside the model.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import torch
import torch.nn.functional as F

from unirl.models.janus import JanusModelConfig
from unirl.models.janus.pretrain import nearest_codes, normalized_vq_forward, pixels, restart_dead_codes
from worlds.shapes import GenEvalMini, ShapesDataset


@torch.no_grad()
def round_trip(bundle, n: int = 256, seed: int = 123) -> dict[str, float]:
    """GenEvalMini (strict) of held-out renders through the tokenizer and back: encode, take
    each latent's code (`nearest_codes`), decode with the library's `decode_image_tokens` (as
    generation does). The ceiling of any image the AR model can draw with these codes."""
    vq = bundle.model.model.vqmodel
    images, prompts = ShapesDataset("eval", 0).sample_batch(n, np.random.default_rng(seed), bundle.image_size)
    codes = nearest_codes(vq, pixels(images))
    decoded = bundle.decode(codes)
    scores = GenEvalMini().evaluate(decoded, prompts)
    return {
        "round_trip_strict": scores["accuracy_strict_samples"],
        "round_trip_dense": scores["dense"],
        "renders_strict": GenEvalMini().evaluate(images, prompts)["accuracy_strict_samples"],
        "codes_used": int(codes.unique().numel()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--restart_every", type=int, default=25, help="steps between dead-code restarts")
    parser.add_argument("--tiny", default="{}", help="TinyJanusConfig keys as JSON")
    parser.add_argument("--eval_every", type=int, default=0, help="steps between round trips (0: at the end)")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    bundle = JanusModelConfig(tiny=json.loads(args.tiny)).build()
    vq = bundle.model.model.vqmodel
    vq.train()
    opt = torch.optim.AdamW(vq.parameters(), lr=args.lr, weight_decay=0.0)
    # cosine decay to 0 over the run (a constant rate leaves the codes jittering)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + np.cos(np.pi * s / args.steps)))
    data, rng = ShapesDataset("train", 0), np.random.default_rng(args.seed)
    size = bundle.image_size
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "vq_log.jsonl"), "w")
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        images, _ = data.sample_batch(args.batch, rng)
        x = pixels(images)
        if x.shape[-1] != size:
            x = F.interpolate(x, size=(size, size), mode="area")
        decoded, codebook_loss = normalized_vq_forward(vq, x)
        mse = (decoded - x).square().mean()
        loss = mse + codebook_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % args.restart_every == 0:
            restart_dead_codes(vq, x)
        if step % 50 == 0 or step == args.steps:
            with torch.no_grad():
                codes = nearest_codes(vq, x).unique().numel()
            row = {
                "step": step,
                "mse": float(mse.detach()),
                "codes_used": codes,
                "seconds": time.perf_counter() - t0,
            }
            if step == args.steps or (args.eval_every and step % args.eval_every == 0):
                vq.eval()
                row.update(round_trip(bundle))
                vq.train()
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")
    log.close()
    vq.eval()
    bundle.save_pretrained(args.out)


if __name__ == "__main__":
    main()
