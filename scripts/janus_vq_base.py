"""Train the VQ tokenizer of a tiny Janus on the shapes renders and save the model directory.

The first half of a Janus-style shapes base (issue 27, item 5): the VQ-VAE (encoder,
codebook, decoder) learns to reconstruct the shapes world's training renders (resized to the
model's image size), so its codes decode to distinct colours and parts of shapes; the
backbone and both heads stay as initialised. `JanusModelConfig(pretrained_path=OUT)` (a
recipe's `model.pretrained_path`, or `UNIFIED_MODEL` for `unified/shapes_bicot_grpo`) loads it.

    python scripts/janus_vq_base.py --out outputs/janus_vq16 --steps 300 \
        --tiny '{"max_position_embeddings": 128}'

Prints one line per 50 steps (step, reconstruction MSE, codes in use of the batch, seconds) and
writes `vq_log.jsonl` beside the model.
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
from unirl.shapes import ShapesDataset


def normalized_vq_forward(vq, x: torch.Tensor, beta: float = 0.25) -> tuple[torch.Tensor, torch.Tensor]:
    """(reconstruction [B, 3, S, S], codebook + commitment loss) of the quantizer Janus decodes
    with: latents and codebook l2-normalised (as `get_codebook_entry` normalises the codes at
    generation), nearest code by cosine, straight-through gradient to the encoder (LlamaGen's VQ)."""
    z = F.normalize(vq.quant_conv(vq.encoder(x)), dim=1)  # [B, D, h, w]
    codes = F.normalize(vq.quantize.embedding.weight, dim=-1)  # [K, D]
    flat = z.permute(0, 2, 3, 1).reshape(-1, z.shape[1])
    q = codes[(flat @ codes.T).argmax(-1)]
    loss = (q - flat.detach()).square().mean() + beta * (q.detach() - flat).square().mean()
    q = (flat + (q - flat).detach()).reshape(z.shape[0], z.shape[2], z.shape[3], -1).permute(0, 3, 1, 2)
    return vq.decoder(vq.post_quant_conv(q)), loss


def nearest_codes(vq, x: torch.Tensor) -> torch.Tensor:
    """[B * h * w] the code of each latent of `x` by cosine (the normalised quantizer's choice)."""
    z = (
        F.normalize(vq.quant_conv(vq.encoder(x)), dim=1)
        .permute(0, 2, 3, 1)
        .reshape(-1, vq.quantize.embedding_dim)
    )
    return (z @ F.normalize(vq.quantize.embedding.weight, dim=-1).T).argmax(-1)


@torch.no_grad()
def restart_dead_codes(vq, x: torch.Tensor) -> int:
    """Move every codebook vector no latent of batch `x` chose onto a random latent of the batch
    (the usual cure for codebook collapse); returns how many moved."""
    latents = (
        F.normalize(vq.quant_conv(vq.encoder(x)), dim=1)
        .permute(0, 2, 3, 1)
        .reshape(-1, vq.quantize.embedding_dim)
    )
    used = nearest_codes(vq, x).unique()
    dead = torch.ones(vq.quantize.num_embeddings, dtype=torch.bool)
    dead[used] = False
    picks = torch.randint(0, latents.shape[0], (int(dead.sum()),))
    vq.quantize.embedding.weight[dead] = latents[picks]
    return int(dead.sum())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--restart_every", type=int, default=25, help="steps between dead-code restarts")
    parser.add_argument("--tiny", default="{}", help="TinyJanusConfig keys as JSON")
    args = parser.parse_args()
    torch.manual_seed(args.seed)
    bundle = JanusModelConfig(tiny=json.loads(args.tiny)).build()
    vq = bundle.model.model.vqmodel
    vq.train()
    opt = torch.optim.AdamW(vq.parameters(), lr=args.lr, weight_decay=0.0)
    data, rng = ShapesDataset("train", 0), np.random.default_rng(args.seed)
    size = bundle.image_size
    os.makedirs(args.out, exist_ok=True)
    log = open(os.path.join(args.out, "vq_log.jsonl"), "w")
    t0 = time.perf_counter()
    for step in range(1, args.steps + 1):
        images, _ = data.sample_batch(args.batch, rng)
        x = torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1  # [-1, 1], as Janus normalises
        if x.shape[-1] != size:
            x = F.interpolate(x, size=(size, size), mode="area")
        decoded, codebook_loss = normalized_vq_forward(vq, x)
        mse = (decoded - x).square().mean()
        loss = mse + codebook_loss
        opt.zero_grad()
        loss.backward()
        opt.step()
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
            print(json.dumps(row), flush=True)
            log.write(json.dumps(row) + "\n")
    log.close()
    vq.eval()
    bundle.save_pretrained(args.out)


if __name__ == "__main__":
    main()
