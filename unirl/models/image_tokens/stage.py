"""The shared image-token stage: a unified model's VQ image tokens after a text context, with
classifier-free guidance, their log-probs, replay and the VQ decode, over any bundle that
satisfies `ImageTokenFamily` (`family.py`; Janus's bundle is one).

A context is text token ids ending in the family's begin-of-image token (the prompt, the plan,
BOI). Its unconditional twin is the same row with every token but the family's
`uncond_keep_ids` replaced by the pad token (Janus: BOS and BOI, as
`JanusForConditionalGeneration.generate(generation_mode="image")` builds it). Text positions are
embedded by the family's `embed_text`, image positions by its `embed_image`; the hidden state of
the last position goes through its `image_logits` to logits over the codebook [K]. With
guidance scale s the guided logits are g = u + s (c - u) (cond c, uncond u; s = 1 runs the cond
rows only). A token is
*chosen* from softmax(g / T) restricted by top-k / top-p with one uniform per step from the
sample's own generator; the *recorded* log-prob is `log_softmax(g / T)` at the token, which
`token_log_probs` recomputes, so the first on-policy ratio is 1.
Shapes: B samples, C_i context tokens of sample i, N image tokens, K codebook entries, D hidden.
"""

from __future__ import annotations

from typing import Any

import torch

from unirl.models.causal_lm.stage import draw, sampling_probs, token_log_probs_of
from unirl.models.image_tokens.family import ImageTokenFamily, image_token_family_problems
from unirl.models.stage import TokenModelStage
from unirl.types.sampling import ImageTokenSamplingParams
from unirl.types.segments import TokenSegment, pad_right


def unwrapped(module: torch.nn.Module) -> torch.nn.Module:
    """The family's model inside `module` (a peft wrapper's base model; LoRA layers are
    injected in place, so its submodules run the adapters)."""
    return module.get_base_model() if hasattr(module, "get_base_model") else module


class VQImageStage(TokenModelStage):
    """Sampling and replay of a unified model's image tokens.

    Args:
        bundle: an `ImageTokenFamily` (checked when built: a missing member raises TypeError
            naming it).
        autocast_dtype: run forwards under `torch.autocast` in this dtype (None: the
            parameters' dtype); logits go to fp32 before any softmax.

    `module` is the model actually called; the train backend replaces it with its wrapped
    module (the plan's text stage holds the same one: one backbone, two tracks).
    """

    def __init__(self, bundle: ImageTokenFamily, autocast_dtype: str | None = None) -> None:
        super().__init__(bundle, autocast_dtype, image_token_family_problems(bundle))
        self.pad_id = int(bundle.tokenizer.pad_token_id)
        self.keep_ids = list(bundle.uncond_keep_ids)
        self.num_image_tokens = bundle.num_image_tokens
        self.codebook_size = bundle.codebook_size

    def model_info(self) -> dict[str, Any]:
        return {
            **super().model_info(),
            "num_image_tokens": self.num_image_tokens,
            "codebook_size": self.codebook_size,
            "image_size": self.bundle.image_size,
        }

    # ---- contexts ---------------------------------------------------------------------------
    def image_context(self, prompt_ids: torch.Tensor, plan_ids: torch.Tensor) -> torch.Tensor:
        """[C] the context an image is drawn after: prompt, plan (its stop token included), BOI."""
        boi = torch.tensor([self.bundle.boi_token_id], dtype=torch.long, device=prompt_ids.device)
        return torch.cat([prompt_ids, plan_ids.to(prompt_ids.device), boi])

    def unconditional(self, context: torch.Tensor) -> torch.Tensor:
        """[C] the unconditional twin of a context: pad everywhere but the family's `uncond_keep_ids`."""
        keep = torch.isin(context, torch.tensor(self.keep_ids, device=context.device))
        return torch.where(keep, context, torch.full_like(context, self.pad_id))

    def _rows(self, contexts: list[torch.Tensor], guided: bool) -> list[torch.Tensor]:
        return contexts + [self.unconditional(c) for c in contexts] if guided else list(contexts)

    def _autocast(self, device: torch.device):
        return torch.autocast(device.type, self.autocast_dtype, enabled=self.autocast_dtype is not None)

    def check_tokens(self, segment: TokenSegment, sample_ids: list[str] | None = None) -> None:
        """Raise naming the sample when an image row is not `num_image_tokens` codebook indices."""
        for i, r in enumerate(segment.response_ids):
            name = sample_ids[i] if sample_ids else f"#{i}"
            if r.numel() != self.num_image_tokens:
                raise ValueError(
                    f"sample {name!r}: {r.numel()} image tokens, the model draws {self.num_image_tokens}"
                )
            bad = (r < 0) | (r >= self.codebook_size)
            if bool(bad.any()):
                raise ValueError(
                    f"sample {name!r}: image token id {int(r[bad][0])} is outside the codebook "
                    f"[0, {self.codebook_size})"
                )

    # ---- rollout ----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(
        self, contexts: list[torch.Tensor], seeds: list[int], sampling: ImageTokenSamplingParams
    ) -> tuple[TokenSegment, torch.Tensor]:
        """Draw `num_image_tokens` image tokens after each context [C_i] (ending in BOI).

        The cond rows and, when guided, the uncond rows run as one left-padded batch of 2B
        rows with a KV cache (attention mask, positions from the mask); each step feeds the
        chosen token's generation embedding to both halves. `seeds[i]` seeds sample i's own
        generator, so its tokens do not depend on its batch-mates.

        Returns (TokenSegment: prompt_ids the contexts, response_ids the image tokens [N],
        their recorded log-probs, `temperature` and `guidance_scale`; media [B, 3, S, S] uint8).
        """
        family, model = self.bundle, unwrapped(self.module)
        backbone = family.backbone(model)
        device = self.device
        scale = float(sampling.guidance_scale)
        rows = self._rows([c.to(device) for c in contexts], scale != 1.0)
        b, n = len(contexts), len(rows)
        width = max(int(r.numel()) for r in rows)
        ids = torch.full((n, width), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros(n, width, dtype=torch.long, device=device)
        for i, r in enumerate(rows):
            ids[i, width - r.numel() :] = r
            mask[i, width - r.numel() :] = 1
        positions = (mask.cumsum(-1) - 1).clamp_(min=0)
        embeds = family.embed_text(model, ids)
        gens = [torch.Generator().manual_seed(int(s)) for s in seeds]
        tokens, log_probs, cache = [], [], None
        was_training = self.module.training
        self.module.eval()
        try:
            with self._autocast(device):
                for _ in range(self.num_image_tokens):
                    out = backbone(
                        inputs_embeds=embeds,
                        attention_mask=mask,
                        position_ids=positions,
                        past_key_values=cache,
                        use_cache=True,
                    )
                    cache = out.past_key_values
                    logits = family.image_logits(model, out.last_hidden_state[:, -1]).float()
                    guided = self.guide(logits[:b], logits[b:], scale)
                    if sampling.greedy:
                        token = guided.argmax(dim=-1)
                    else:
                        uniforms = torch.cat(
                            [torch.rand(1, 1, generator=g, dtype=torch.float64) for g in gens]
                        )
                        probs = sampling_probs(guided, sampling.temperature, sampling.top_k, sampling.top_p)
                        token = draw(probs, uniforms.to(device))
                    tokens.append(token)
                    log_probs.append(token_log_probs_of(guided, token, sampling.logit_temperature))
                    embeds = family.embed_image(model, token.repeat(n // b)[:, None])
                    mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                    positions = positions[:, -1:] + 1
        finally:
            self.module.train(was_training)
        token_mat, lp_mat = torch.stack(tokens, dim=1), torch.stack(log_probs, dim=1)
        segment = TokenSegment(
            prompt_ids=[c.to(device) for c in contexts],
            response_ids=list(token_mat.unbind(0)),
            log_probs=list(lp_mat.unbind(0)),
            temperature=sampling.logit_temperature,
            guidance_scale=scale,
        )
        return segment, self.decode(token_mat)

    @staticmethod
    def guide(cond: torch.Tensor, uncond: torch.Tensor, scale: float) -> torch.Tensor:
        """Guided logits u + s (c - u) (fp32); the cond logits themselves when s = 1."""
        if scale == 1.0:
            return cond.float()
        return uncond.float() + scale * (cond.float() - uncond.float())

    def decode(self, image_tokens: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] uint8 images of [B, N] codebook indices (the family's `decode`)."""
        return self.bundle.decode(image_tokens)

    # ---- replay -----------------------------------------------------------------------------
    def token_log_probs(self, segment: TokenSegment) -> torch.Tensor:
        """[B, N] fp32 log-probs of the image tokens under the current `module`, guided with
        `segment.guidance_scale` at `segment.temperature`. Differentiable.

        One forward over the 2B rows (cond contexts, then their uncond twins when guided), each
        context_i + image_i[:-1], right-padded (positions 0..L_i-1): text positions take the
        text embeddings, image positions the generation embeddings; positions C_i-1 ..
        C_i+N-2 predict the image tokens. A row's values do not depend on its batch-mates.
        """
        if segment.guidance_scale is None:
            raise ValueError("VQImageStage.token_log_probs needs an image-token segment (guidance_scale set)")
        self.check_tokens(segment)
        family, model = self.bundle, unwrapped(self.module)
        device = self.device
        scale = float(segment.guidance_scale)
        contexts = [p.to(device) for p in segment.prompt_ids]
        images = [r.to(device) for r in segment.response_ids]
        rows = self._rows(contexts, scale != 1.0)
        images = images * (len(rows) // len(contexts))
        seqs = [
            torch.cat([family.embed_text(model, c), family.embed_image(model, img[:-1])])
            for c, img in zip(rows, images, strict=True)
        ]
        lengths = [int(s.shape[0]) for s in seqs]
        width = max(lengths)
        embeds = torch.stack([torch.nn.functional.pad(s, (0, 0, 0, width - s.shape[0])) for s in seqs])
        mask = pad_right([torch.ones(n, dtype=torch.long, device=device) for n in lengths], 0)
        positions = torch.arange(width, device=device).expand(len(rows), width)
        with self._autocast(device):
            hidden = family.backbone(model)(
                inputs_embeds=embeds, attention_mask=mask, position_ids=positions, use_cache=False
            ).last_hidden_state
            n_img = self.num_image_tokens
            starts = torch.tensor([int(c.numel()) - 1 for c in rows], device=device)
            index = starts[:, None] + torch.arange(n_img, device=device)
            picked = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
            logits = family.image_logits(model, picked).float()  # [rows, N, K]
        b = len(contexts)
        guided = self.guide(logits[:b], logits[b:], scale)
        targets = torch.stack(images[:b])
        return token_log_probs_of(guided, targets, segment.temperature)
