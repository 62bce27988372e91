"""The causal-LM text stage: generate (rollout, KV cache) and token_log_probs (replay).

Both score a token with one function, `token_log_probs_of(logits, tokens,
temperature)` = `log_softmax(logits.float() / temperature)` gathered at the
token, so the log-prob a rollout records and the one replay recomputes come
from the same arithmetic (top-k / top-p only shape which token is *chosen*).
Shapes: B samples, P_i prompt and R_i response tokens of sample i, V vocab.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule

from unirl.models.causal_lm.family import TextFamily, text_family_problems
from unirl.models.causal_lm.ulysses import group_of, ulysses_attention
from unirl.models.stage import AUTOCAST_DTYPES as AUTOCAST_DTYPES
from unirl.models.stage import TokenModelStage
from unirl.models.ulysses import gather_seq
from unirl.types.rollout_req import RolloutReq
from unirl.types.sampling import TextSamplingParams
from unirl.types.segments import TokenSegment, pad_right


def token_log_probs_of(logits: torch.Tensor, tokens: torch.Tensor, temperature: float) -> torch.Tensor:
    """[...] fp32 log-probs of `tokens` [...] under `log_softmax(logits [..., V] / temperature)`."""
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def sampling_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """[B, V] fp32 distribution tokens are drawn from: softmax(logits / temperature)
    restricted to the `top_k` most likely tokens (0: all), then to the smallest set
    whose mass reaches `top_p` (1: all), renormalized."""
    scaled = logits.float() / temperature
    if 0 < top_k < scaled.shape[-1]:
        kth = scaled.topk(top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = scaled.sort(dim=-1, descending=True)
        sorted_probs = sorted_logits.softmax(dim=-1)
        # drop a token when the mass before it already reaches top_p (the most likely always stays)
        drop_sorted = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        drop = drop_sorted.scatter(-1, order, drop_sorted)
        scaled = scaled.masked_fill(drop, float("-inf"))
    return scaled.softmax(dim=-1)


def draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """[B] token ids by inverse CDF: row b's first token whose cumulative mass exceeds
    `uniforms[b]` (in [0, 1)) times the row's total. Zero-mass tokens are never drawn."""
    cdf = probs.double().cumsum(dim=-1)
    target = uniforms.to(cdf) * cdf[:, -1:]
    return torch.searchsorted(cdf, target, right=True).clamp_(max=probs.shape[-1] - 1).squeeze(-1)


def is_sharded(module: torch.nn.Module) -> bool:
    """Whether any part of `module` is an FSDP2 unit (its forwards are collectives)."""
    return any(isinstance(m, FSDPModule) for m in module.modules())


def done_on_every_rank(done: bool, sharded: bool, device: torch.device) -> bool:
    """`done` on every rank of the default group when `sharded` (one MIN all-reduce), else `done`.

    A generation loop over an FSDP-sharded module must stop on every rank at the same step:
    each forward all-gathers parameters, so a rank whose samples all stopped early would leave
    the others waiting in (or matching the wrong) collective."""
    import torch.distributed as dist

    if not sharded or not dist.is_initialized() or dist.get_world_size() == 1:
        return done
    flag = torch.tensor([int(done)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


@dataclass
class Draft:
    """The responses of a request sampled over one or several calls (a partial rollout resumes
    its unfinished samples after a weight sync): per sample i, `tokens[i]` [R_i] long and
    `log_probs[i]` [R_i] fp32 so far, `versions[i]` [R_i] long the weight version that sampled
    each token, `done[i]` (ended at a stop token or after `max_new_tokens`) and `gens[i]` its
    generator (seeded by `req.seeds[i]`, continued by every call). `prompts`, `pixel_values`
    and `grids` are the stage's encoding of the request (`CausalLMStage.encode`)."""

    req: RolloutReq
    prompts: list[torch.Tensor]
    pixel_values: list[torch.Tensor] | None
    grids: list[torch.Tensor] | None
    tokens: list[torch.Tensor]
    log_probs: list[torch.Tensor]
    versions: list[torch.Tensor]
    done: list[bool]
    gens: list[torch.Generator]

    @classmethod
    def of(cls, req: RolloutReq, prompts: list, pixel_values: Any, grids: Any, device: Any) -> Draft:
        """An empty draft of `req` (no token sampled yet)."""
        n = len(prompts)
        return cls(
            req=req,
            prompts=prompts,
            pixel_values=pixel_values,
            grids=grids,
            tokens=[torch.zeros(0, dtype=torch.long, device=device) for _ in range(n)],
            log_probs=[torch.zeros(0, dtype=torch.float32, device=device) for _ in range(n)],
            versions=[torch.zeros(0, dtype=torch.long) for _ in range(n)],
            done=[False] * n,
            gens=[torch.Generator().manual_seed(int(s)) for s in req.seeds],
        )

    def add(self, i: int, tokens: torch.Tensor, log_probs: torch.Tensor, version: int, stopped: bool) -> None:
        """Append sample i's new `tokens` and their `log_probs`, sampled by weight `version`;
        it is done after a stop token or once it holds `max_new_tokens`."""
        self.tokens[i] = torch.cat([self.tokens[i], tokens])
        self.log_probs[i] = torch.cat([self.log_probs[i], log_probs.float()])
        self.versions[i] = torch.cat(
            [self.versions[i], torch.full((tokens.numel(),), version, dtype=torch.long)]
        )
        self.done[i] = stopped or self.tokens[i].numel() >= self.req.sampling.max_new_tokens

    def version_counts(self) -> dict[int, int]:
        """Tokens sampled so far by each weight version."""
        counts: dict[int, int] = {}
        for v in self.versions:
            for version, n in zip(*torch.unique(v, return_counts=True), strict=True):
                counts[int(version)] = counts.get(int(version), 0) + int(n)
        return counts

    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint keeps to resume the draft (the request and the encoding are rebuilt)."""
        return {
            "tokens": [t.cpu() for t in self.tokens],
            "log_probs": [lp.cpu() for lp in self.log_probs],
            "versions": list(self.versions),
            "done": list(self.done),
            "gens": [g.get_state() for g in self.gens],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        device = self.tokens[0].device if self.tokens else "cpu"
        self.tokens = [t.to(device) for t in state["tokens"]]
        self.log_probs = [lp.to(device) for lp in state["log_probs"]]
        self.versions = list(state["versions"])
        self.done = list(state["done"])
        for g, st in zip(self.gens, state["gens"], strict=True):
            g.set_state(st)


class CausalLMStage(TokenModelStage):
    """Sampling and replay of a causal LM.

    Args:
        bundle: the model bundle, a `TextFamily` (model and tokenizer; a `VisionTextFamily`
            when its prompts carry images); checked when the stage is built.
        autocast_dtype: run the model's forward under `torch.autocast` in this
            dtype ("bfloat16" or "float16"; None: the parameters' dtype).
            Rollout and replay share the forward; logits are cast to fp32
            before any softmax.

    `module` is the LM actually called; the train backend replaces it with its
    wrapped (LoRA / FSDP) module so rollout and replay use the trained weights.
    """

    def __init__(self, bundle: TextFamily, autocast_dtype: str | None = None) -> None:
        super().__init__(bundle, autocast_dtype, text_family_problems(bundle))
        self.tokenizer = bundle.tokenizer
        config = bundle.model.config.get_text_config()  # a VLM's decoder settings sit in text_config
        self.max_positions: int = config.max_position_embeddings
        self.vocab_rows: int = bundle.model.get_input_embeddings().num_embeddings
        # a VLM's vision placeholders mean "an image goes here": a response must not hold them
        self.unsampled_ids: list[int] = list(bundle.vision_token_ids)

    def model_info(self) -> dict[str, Any]:
        return {
            **super().model_info(),
            "vocab_size": len(self.tokenizer),
            "embedding_rows": self.vocab_rows,
            "max_position_embeddings": self.max_positions,
            "eos_token_id": self.tokenizer.eos_token_id,
            "pad_token_id": self.tokenizer.pad_token_id,
        }

    def _forward(self, **kwargs) -> Any:
        device = kwargs["input_ids"].device
        with torch.autocast(device.type, self.autocast_dtype, enabled=self.autocast_dtype is not None):
            return self.module(**kwargs)

    # ---- prompts ----------------------------------------------------------------------------
    def encode_prompts(self, req: RolloutReq) -> list[torch.Tensor]:
        """Per sample [P_i] long prompt ids (`encode`'s ids)."""
        return self.encode(req)[0]

    def encode(
        self, req: RolloutReq
    ) -> tuple[list[torch.Tensor], list[torch.Tensor] | None, list[torch.Tensor] | None]:
        """(prompt ids per sample [P_i] long, pixel values per sample [N_i, D] or None,
        image grids per sample [k_i, 3] or None).

        The chat template is applied as one user turn with the generation prompt when
        `sampling.chat_template`. A vision-language bundle reads each sample's
        `metadata["images"]` and expands the prompt's `<image>` placeholders into vision
        tokens (`VisionTextFamily.prepare`); a text-only bundle rejects rows that carry images.
        Too long or empty is an error naming the sample.
        """
        sp: TextSamplingParams = req.sampling
        vision = self.bundle.has_vision
        # a group's samples share their prompt row (text and images): prepare it once
        keys = [(g, p) if vision else p for g, p in zip(req.group_ids, req.prompts, strict=True)]
        first = {}
        for i, key in enumerate(keys):
            first.setdefault(key, i)
        prepared = {}
        for key, i in first.items():
            sid, prompt, images = req.sample_ids[i], req.prompts[i], req.metadata[i].get("images")
            if vision:
                prepared[key] = self.bundle.prepare(prompt, list(images or []), sid)
            elif images:
                raise ValueError(
                    f"sample {sid!r}: the row carries {len(images)} image(s) (metadata['images']) but the model "
                    "is a text-only causal LM; use model._target_=unirl.models.qwen_vl.QwenVLConfig"
                )
            else:
                prepared[key] = (prompt, None, None)
        texts = [prepared[k][0] for k in first]
        if sp.chat_template:
            texts = [
                self.tokenizer.apply_chat_template(
                    [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
                )
                for t in texts
            ]
        encoded = {
            k: torch.tensor(ids, dtype=torch.long)
            for k, ids in zip(
                first, self.tokenizer(texts, add_special_tokens=False)["input_ids"], strict=True
            )
        }
        ids = [encoded[k] for k in keys]
        for sid, p in zip(req.sample_ids, ids, strict=True):
            if p.numel() > sp.max_prompt_length:
                raise ValueError(
                    f"sample {sid!r}: the prompt is {p.numel()} tokens, more than "
                    f"sampling.max_prompt_length={sp.max_prompt_length}; raise it or shorten the prompt"
                )
            if p.numel() + sp.max_new_tokens > self.max_positions:
                raise ValueError(
                    f"sample {sid!r}: prompt ({p.numel()} tokens) + sampling.max_new_tokens "
                    f"({sp.max_new_tokens}) exceeds the model's max_position_embeddings ({self.max_positions})"
                )
            if p.numel() == 0:
                raise ValueError(f"sample {sid!r}: the prompt is empty (0 tokens)")
        if not vision:
            return ids, None, None
        return ids, [prepared[k][1] for k in keys], [prepared[k][2] for k in keys]

    def _positions(self, input_ids: torch.Tensor, mask: torch.Tensor, images: dict | None) -> torch.Tensor:
        """Positions of a padded batch: [B, L] from the mask for a text LM (`images` None), the
        VLM's multimodal [3, B, L] from the forward's image arguments (`VisionTextFamily.vision_inputs`)."""
        if images is None:
            return (mask.cumsum(-1) - 1).clamp_(min=0)
        return self.bundle.positions(input_ids, mask, images.get("image_grid_thw"))

    def stop_token_ids(self, sp: TextSamplingParams) -> list[int]:
        """EOS plus `sampling.stop_tokens`, each of which must be exactly one token."""
        ids = [self.tokenizer.eos_token_id]
        for s in sp.stop_tokens:
            enc = self.tokenizer.encode(s, add_special_tokens=False)
            if len(enc) != 1:
                raise ValueError(
                    f"sampling.stop_tokens entry {s!r} is {len(enc)} tokens ({enc}) for this tokenizer; "
                    "each stop token must be exactly one token"
                )
            ids.append(enc[0])
        return ids

    def decode_responses(self, responses: list[torch.Tensor], stop_ids: list[int]) -> list[str]:
        """The text of each response, its final stop token (EOS or a stop token) left out."""
        stop_set = set(stop_ids)
        return [
            self.tokenizer.decode(r[:-1] if int(r[-1]) in stop_set else r, skip_special_tokens=False)
            for r in (x.cpu() for x in responses)
        ]

    # ---- rollout ----------------------------------------------------------------------------
    @torch.no_grad()
    def generate(self, req: RolloutReq) -> tuple[TokenSegment, list[str]]:
        """Sample a response for each of the `len(req)` samples under `req.sampling`.

        Prompts are left-padded into one batch (attention mask, positions from
        the mask) and extended with a KV cache. Each step chooses from
        `sampling_probs` (temperature, top-k, top-p; argmax when greedy) with
        one uniform per sample from a CPU generator seeded by `req.seeds[i]`,
        so a sample's tokens do not depend on its batch-mates or device; the
        recorded log-prob is the token's under `log_softmax(logits /
        logit_temperature)`. A VLM's vision placeholder tokens are never chosen
        (as top-k, this shapes the choice, not the recorded log-prob). A sample ends at EOS or a stop token (kept in its
        response ids, left out of its text) or after `max_new_tokens`. Over an FSDP-sharded
        module the loop runs until every rank's samples have ended (`done_on_every_rank`).
        It is `draft`, one `extend` by `max_new_tokens`, then `segment_of`.

        Returns (TokenSegment on the module's device, decoded response texts).
        """
        draft = self.draft(req)
        self.extend(draft, req.sampling.max_new_tokens)
        return self.segment_of(draft)

    def draft(self, req: RolloutReq) -> Draft:
        """An empty `Draft` of `req` (its prompts encoded, each sample's generator seeded by
        `req.seeds[i]`), for `extend` to sample into."""
        sp: TextSamplingParams = req.sampling
        if not isinstance(sp, TextSamplingParams):
            raise TypeError(f"CausalLMStage.generate needs TextSamplingParams, got {type(sp).__name__}")
        prompts, pixel_values, grids = self.encode(req)
        return Draft.of(req, prompts, pixel_values, grids, self.device)

    @torch.no_grad()
    def extend(self, draft: Draft, max_tokens: int, version: int = 0, rows: list[int] | None = None) -> None:
        """Sample at most `max_tokens` more tokens for each unfinished sample of `draft` (of `rows`,
        its sample indices, when given: a forward batch) (a partial rollout's segment) with the
        weights the module holds now, recorded as weight `version`. The unfinished samples' prompts and tokens so far are prefilled as one
        left-padded batch, then extended with the KV cache, as `generate` describes; a sample
        stops at a stop token or at `max_new_tokens` in all (then it is done) or after
        `max_tokens` here (then a later `extend` resumes it). Only a running sample draws its
        uniform, so extending a draft in several calls under unchanged weights samples what one
        call does."""
        sp: TextSamplingParams = draft.req.sampling
        rows = [i for i in (range(len(draft.done)) if rows is None else rows) if not draft.done[i]]
        if not rows or max_tokens < 1:
            return
        stop_ids = torch.tensor(self.stop_token_ids(sp))
        device = self.device
        prefixes = [torch.cat([draft.prompts[i].to(device), draft.tokens[i]]) for i in rows]
        b = len(rows)
        width = max(int(p.numel()) for p in prefixes)
        input_ids = torch.full((b, width), self.tokenizer.pad_token_id, dtype=torch.long, device=device)
        mask = torch.zeros(b, width, dtype=torch.long, device=device)
        for k, p in enumerate(prefixes):
            input_ids[k, width - p.numel() :] = p
            mask[k, width - p.numel() :] = 1
        stop_ids = stop_ids.to(device)
        images = None
        if draft.grids is not None:
            images = self.bundle.vision_inputs(
                [draft.pixel_values[i] for i in rows], [draft.grids[i] for i in rows], device
            )
        positions = self._positions(input_ids, mask, images)
        images = images or {}
        gens = [draft.gens[i] for i in rows]
        budget = torch.tensor(
            [min(max_tokens, sp.max_new_tokens - int(draft.tokens[i].numel())) for i in rows], device=device
        )
        tokens, log_probs = [], []
        stopped = budget <= 0
        hit_stop = torch.zeros(b, dtype=torch.bool, device=device)
        lengths = torch.zeros(b, dtype=torch.long, device=device)
        cache = None
        sharded = is_sharded(self.module)  # then every rank runs the same number of forwards
        was_training = self.module.training
        self.module.eval()
        try:
            for _ in range(int(budget.max())):
                out = self._forward(
                    input_ids=input_ids,
                    attention_mask=mask,
                    position_ids=positions,
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                    **images,
                )
                images = {}  # the prompt's images are in the cache after the first forward
                cache, logits = out.past_key_values, out.logits[:, -1]
                choice = logits
                if self.unsampled_ids:  # never chosen (the recorded log-prob stays the full softmax's)
                    choice = logits.index_fill(
                        -1, torch.tensor(self.unsampled_ids, device=device), float("-inf")
                    )
                if sp.greedy:
                    token = choice.argmax(dim=-1)
                else:
                    running = (~stopped).tolist()
                    uniforms = torch.cat(
                        [
                            torch.rand(1, 1, generator=g, dtype=torch.float64)
                            if r
                            else torch.zeros(1, 1, dtype=torch.float64)
                            for g, r in zip(gens, running, strict=True)
                        ]
                    )
                    token = draw(
                        sampling_probs(choice, sp.temperature, sp.top_k, sp.top_p), uniforms.to(device)
                    )
                token = token.masked_fill(stopped, self.tokenizer.pad_token_id)
                tokens.append(token)
                log_probs.append(token_log_probs_of(logits, token, sp.logit_temperature))
                lengths += ~stopped
                hit_stop |= torch.isin(token, stop_ids) & ~stopped
                stopped |= hit_stop | (lengths >= budget)
                if done_on_every_rank(bool(stopped.all()), sharded, device):
                    break
                input_ids = token[:, None]
                mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
                positions = positions[..., -1:] + 1  # every rotary axis: text continues one by one
        finally:
            self.module.train(was_training)
        token_mat, lp_mat = torch.stack(tokens, dim=1), torch.stack(log_probs, dim=1)
        for k, (i, n) in enumerate(zip(rows, lengths.tolist(), strict=True)):
            draft.add(i, token_mat[k, :n], lp_mat[k, :n], version, bool(hit_stop[k]))

    def segment_of(self, draft: Draft) -> tuple[TokenSegment, list[str]]:
        """(TokenSegment, decoded texts) of the draft's responses so far."""
        sp: TextSamplingParams = draft.req.sampling
        device = self.device
        texts = self.decode_responses(draft.tokens, self.stop_token_ids(sp))
        segment = TokenSegment(
            prompt_ids=[p.to(device) for p in draft.prompts],
            response_ids=[t.to(device) for t in draft.tokens],
            log_probs=[lp.to(device) for lp in draft.log_probs],
            temperature=sp.logit_temperature,
            pixel_values=draft.pixel_values,
            image_grid_thw=draft.grids,
        )
        return segment, texts

    def teacher_forced(self, req: RolloutReq, responses: list[str]) -> TokenSegment:
        """The segment of `req` whose responses are the given texts rather than samples (a
        supervised track's demonstrations): prompt ids as `encode` makes them (chat template,
        a VLM's images), response i the tokens of `responses[i]`
        (`tokenizer(text, add_special_tokens=False)`) + EOS, as `encode_pairs` builds an SFT row.
        Nothing was sampled, so `log_probs` are zeros and the temperature is 1 (the
        cross-entropy's). A response longer than `sampling.max_new_tokens` is an error naming
        the sample (the prompt's bounds are `encode`'s)."""
        sp: TextSamplingParams = req.sampling
        prompts, pixel_values, grids = self.encode(req)
        tokens = self.tokenizer(list(responses), add_special_tokens=False)["input_ids"]
        eos = self.tokenizer.eos_token_id
        response_ids = []
        for sid, text, ids in zip(req.sample_ids, responses, tokens, strict=True):
            row = torch.tensor([*ids, eos], dtype=torch.long)
            if row.numel() > sp.max_new_tokens:
                raise ValueError(
                    f"sample {sid!r}: the demonstration {text!r} is {row.numel()} tokens with EOS, more than "
                    f"sampling.max_new_tokens={sp.max_new_tokens}; raise it or shorten the data"
                )
            response_ids.append(row)
        device = self.device
        return TokenSegment(
            prompt_ids=[p.to(device) for p in prompts],
            response_ids=[r.to(device) for r in response_ids],
            log_probs=[torch.zeros(r.numel(), device=device) for r in response_ids],
            temperature=1.0,
            pixel_values=pixel_values,
            image_grid_thw=grids,
        )

    # ---- replay -----------------------------------------------------------------------------
    def token_log_probs(self, segment: TokenSegment) -> torch.Tensor:
        """[B, Rmax] fp32 log-probs of the response tokens under the current `module`
        at `segment.temperature`, right-padded with 0 (mask: `segment.response_mask()`).

        One forward over prompt_i + response_i per row, right-padded (attention mask,
        positions 0..L_i-1, or a VLM's multimodal positions with the segment's images),
        so a row's values do not depend on its batch-mates;
        positions P_i-1 .. P_i+R_i-2 predict the response. Only the logits from the
        shortest prompt's last position on are computed. Differentiable.

        Under Ulysses sequence parallelism (`unirl.models.causal_lm.ulysses`, attached by the
        train backend) each rank of the group forwards one token shard (`_sharded_log_probs`)
        and every rank returns the same [B, Rmax].
        """
        if group_of(self.module) is not None:
            if segment.has_images:
                raise ValueError(
                    "train.parallel.sp > 1: sequence-parallel replay is for text-only causal LMs; a "
                    "vision-language model's rows carry images (set train.parallel.sp=1)"
                )
            return self._sharded_log_probs(segment)
        device = self.device
        seqs = [
            torch.cat([p, r]).to(device)
            for p, r in zip(segment.prompt_ids, segment.response_ids, strict=True)
        ]
        input_ids = pad_right(seqs, self.tokenizer.pad_token_id)
        mask = pad_right([torch.ones_like(s) for s in seqs], 0)
        b, width = input_ids.shape
        p_len = segment.prompt_lengths.to(device)
        r_max = max(int(r.numel()) for r in segment.response_ids)
        start = int(p_len.min()) - 1  # first position whose logits predict a response token
        if segment.has_images:
            images = self.bundle.vision_inputs(segment.pixel_values, segment.image_grid_thw, device)
            positions = self._positions(input_ids, mask, images)
        else:
            positions, images = torch.arange(width, device=device).expand(b, width), {}
        out = self._forward(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=False,
            logits_to_keep=width - start,
            **images,
        )
        # logits row j of out.logits is position start + j; response token k of row i sits
        # at position P_i + k and is predicted by position P_i - 1 + k
        offsets = (p_len - 1 - start)[:, None] + torch.arange(r_max, device=device)
        offsets = offsets.clamp_(max=out.logits.shape[1] - 1)
        logits = out.logits.gather(1, offsets[..., None].expand(-1, -1, out.logits.shape[-1]))
        targets = segment.padded("response_ids").to(device)
        lp = token_log_probs_of(logits, targets, segment.temperature)
        return torch.where(segment.response_mask().to(device).bool(), lp, 0.0)

    def _sharded_log_probs(self, segment: TokenSegment) -> torch.Tensor:
        """`token_log_probs` with this rank's shard of the tokens: the rows right-padded to a
        multiple of the group's P ranks, positions 0..L-1 as unsharded, each token's log-prob of
        its successor computed where the token sits, then gathered along the sequence."""
        import torch.distributed as dist

        device = self.device
        group = group_of(self.module)
        parts, rank = dist.get_world_size(group), dist.get_rank(group)
        pad = self.tokenizer.pad_token_id
        seqs = [
            torch.cat([p, r]).to(device)
            for p, r in zip(segment.prompt_ids, segment.response_ids, strict=True)
        ]
        rows = pad_right(seqs, pad)
        b, width = rows.shape
        width = -(-width // parts) * parts
        rows = torch.nn.functional.pad(rows, (0, width - rows.shape[1]), value=pad)
        following = torch.nn.functional.pad(rows[:, 1:], (0, 1), value=pad)  # each position's next token
        shard = slice(rank * width // parts, (rank + 1) * width // parts)
        positions = torch.arange(width, device=device)[shard].expand(b, -1)
        with ulysses_attention(self.module):
            out = self._forward(input_ids=rows[:, shard], position_ids=positions, use_cache=False)
        lp = gather_seq(token_log_probs_of(out.logits, following[:, shard], segment.temperature), group)
        r_max = max(int(r.numel()) for r in segment.response_ids)
        # response token k of row i is predicted by position P_i - 1 + k
        offsets = (segment.prompt_lengths.to(device) - 1)[:, None] + torch.arange(r_max, device=device)
        lp = lp.gather(1, offsets.clamp_(max=width - 1))
        return torch.where(segment.response_mask().to(device).bool(), lp, 0.0)
