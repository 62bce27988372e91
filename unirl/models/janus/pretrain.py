"""Supervised pretraining of a Janus from scratch: its VQ tokenizer, then its autoregressive
model on (prompt, plan, image tokens) rows, in the tokens a unified rollout uses.

`scripts/janus_vq_base.py` and `scripts/janus_ar_base.py` run these on the shapes world
(`checkpoints/shapes_janus`). Shapes: B rows, N image tokens, D codebook vector size, K codes,
S image side.

- The VQ-VAE trains LlamaGen's normalised quantizer (`normalized_vq_forward`): latents and
  codebook l2-normalised, each latent's cosine-nearest code, straight-through gradient to the
  encoder, codebook + commitment loss. It is the path generation decodes (the library's
  `get_codebook_entry` normalises the codes); `JanusVQVAE.forward` quantizes unnormalised
  latents and passes no gradient to the encoder, and did not train here.
- The AR loss (`teacher_forced_losses`) reads each row as the stage builds it:
  `VQImageStage.image_context(prompt, plan)` (prompt, plan with its stop token, BOI), or its
  unconditional twin for classifier-free-guidance dropout, then the image tokens; the plan's
  cross-entropy comes from the text head, the image tokens' from the generation head, in one
  forward. Its image term equals `-VQImageStage.token_log_probs(...).mean()` at guidance 1
  and temperature 1 (`tests/models/janus/test_janus.py` holds it).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from unirl.models.image_tokens import VQImageStage, unwrapped
from unirl.models.janus.bundle import JanusBundle
from unirl.models.janus.config import PLAN_END_TOKEN
from unirl.types.segments import pad_right


def pixels(images: np.ndarray) -> torch.Tensor:
    """[B, 3, S, S] fp32 in [-1, 1] (as Janus normalises) of uint8 renders [B, S, S, 3]."""
    return torch.from_numpy(images).permute(0, 3, 1, 2).float() / 127.5 - 1


def _latents(vq, x: torch.Tensor) -> torch.Tensor:
    """[B, h, w, D] l2-normalised encoder latents of images x [B, 3, S, S] in [-1, 1]."""
    return F.normalize(vq.quant_conv(vq.encoder(x)), dim=1).permute(0, 2, 3, 1)


def _codebook(vq) -> torch.Tensor:
    """[K, D] the l2-normalised codebook."""
    return F.normalize(vq.quantize.embedding.weight, dim=-1)


def nearest_codes(vq, x: torch.Tensor) -> torch.Tensor:
    """[B, h * w] the cosine-nearest code of each latent of images x (row-major, the image
    tokens' order)."""
    return (_latents(vq, x) @ _codebook(vq).T).argmax(-1).flatten(1)


def normalized_vq_forward(vq, x: torch.Tensor, beta: float = 0.25) -> tuple[torch.Tensor, torch.Tensor]:
    """(reconstruction [B, 3, S, S], codebook + `beta` x commitment loss) of images x through
    the normalised quantizer with a straight-through gradient."""
    z, codes = _latents(vq, x), _codebook(vq)
    q = codes[(z @ codes.T).argmax(-1)]  # [B, h, w, D]
    loss = (q - z.detach()).square().mean() + beta * (q.detach() - z).square().mean()
    q = (z + (q - z).detach()).permute(0, 3, 1, 2)
    return vq.decoder(vq.post_quant_conv(q)), loss


@torch.no_grad()
def restart_dead_codes(vq, x: torch.Tensor) -> int:
    """Move every code no latent of images x chose onto a random latent of the batch (the usual
    cure for codebook collapse); returns how many moved."""
    latents = _latents(vq, x).flatten(0, 2)  # [B * h * w, D]
    dead = torch.ones(vq.quantize.num_embeddings, dtype=torch.bool)
    dead[(latents @ _codebook(vq).T).argmax(-1).unique()] = False
    picks = torch.randint(0, latents.shape[0], (int(dead.sum()),))
    vq.quantize.embedding.weight[dead] = latents[picks]
    return int(dead.sum())


def plan_ids(bundle: JanusBundle, text: str) -> torch.Tensor:
    """[R] a plan's tokens as a rollout samples them: the text, then `<end_of_plan>`."""
    tok = bundle.tokenizer
    ids = tok(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids + [tok.convert_tokens_to_ids(PLAN_END_TOKEN)], dtype=torch.long)


def teacher_forced_losses(
    stage: VQImageStage,
    prompts: list[torch.Tensor],
    plans: list[torch.Tensor],
    images: torch.Tensor,
    uncond: list[bool],
) -> tuple[torch.Tensor, torch.Tensor]:
    """(plan cross-entropy, image cross-entropy), token means, of one batch.

    Args:
        stage: the image stage of the model trained (its `module` runs; contexts as it builds them).
        prompts: per row [P_i] prompt ids (as `CausalLMStage` tokenizes prompts).
        plans: per row [R_i] plan ids ending in the stop token (`plan_ids`).
        images: [B, N] codebook indices.
        uncond: per row, train the unconditional twin (image tokens only, no plan loss).
    """
    family, janus = stage.bundle, unwrapped(stage.module)
    seqs, spans, ctx_lens = [], [], []
    for p, plan, img, drop in zip(prompts, plans, images, uncond, strict=True):
        ctx = stage.image_context(p, plan)
        if drop:
            ctx = stage.unconditional(ctx)
        seqs.append(torch.cat([family.embed_text(janus, ctx), family.embed_image(janus, img[:-1])]))
        spans.append(None if drop else (p.numel(), ctx.numel() - 1, ctx))  # plan tokens at [start, end)
        ctx_lens.append(ctx.numel())
    width = max(s.shape[0] for s in seqs)
    embeds = torch.stack([F.pad(s, (0, 0, 0, width - s.shape[0])) for s in seqs])
    mask = pad_right([torch.ones(s.shape[0], dtype=torch.long, device=embeds.device) for s in seqs], 0)
    hidden = family.backbone(janus)(
        inputs_embeds=embeds, attention_mask=mask, use_cache=False
    ).last_hidden_state  # [B, L, H]
    index = (
        torch.tensor(ctx_lens, device=hidden.device)[:, None]
        - 1
        + torch.arange(images.shape[1], device=hidden.device)
    )  # positions C_i - 1 .. C_i + N - 2 predict the image tokens
    picked = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
    image_ce = F.cross_entropy(family.image_logits(janus, picked).float().flatten(0, 1), images.flatten())
    text_h, text_y = [], []
    for i, span in enumerate(spans):
        if span is not None:
            start, end, ctx = span  # predicted from positions start - 1 .. end - 2
            text_h.append(hidden[i, start - 1 : end - 1])
            text_y.append(ctx[start:end])
    if not text_h:
        return hidden.sum() * 0, image_ce
    plan_ce = F.cross_entropy(janus.lm_head(torch.cat(text_h)).float(), torch.cat(text_y))
    return plan_ce, image_ce
