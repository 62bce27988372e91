"""Ulysses sequence parallelism for a transformers causal LM's replay (`CausalLMStage.token_log_probs`).

`attach(model, group)` (called by `unirl.train.sequence_parallel.enable_ulysses`) records the
sequence-parallel group on the model. Replay then gives each of the group's P ranks one of P
equal shards of the right-padded token rows, with their global positions; inside
`ulysses_attention(model)` every attention layer of the model runs `attention` below: an
all-to-all from token shards to head shards for queries, keys and values (the rotary embedding is
already applied, from the global positions), causal SDPA over the whole sequence, and the inverse
all-to-all. Right padding needs no mask for the real tokens (a pad key sits after every real
query), so the layer's mask is not built. Generation keeps the model's own attention.

Keys and values with fewer heads than P's multiple (grouped-query attention) are repeated to the
query heads first, so any degree dividing the query heads works.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from unirl.models.ulysses import heads_to_seq, seq_to_heads

ATTENTION = "unirl_ulysses"  # the transformers attention implementation registered for replay
_GROUP: contextvars.ContextVar[Any] = contextvars.ContextVar("unirl_ulysses_group", default=None)


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """A transformers attention function (`AttentionInterface`): query [B, H, S/P, D] and key /
    value [B, KV, S/P, D] of this rank's tokens -> output [B, S/P, H, D] of causal attention
    over all S tokens of the group."""
    group = _GROUP.get()
    if group is None:
        raise RuntimeError(f"attention {ATTENTION!r} runs inside `ulysses_attention` only")
    parts = torch.distributed.get_world_size(group)
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads % parts:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    q, k, v = (seq_to_heads(t.transpose(1, 2), group).transpose(1, 2) for t in (query, key, value))
    out = F.scaled_dot_product_attention(
        q, k, v, dropout_p=dropout, is_causal=True, scale=scaling, enable_gqa=k.shape[1] != q.shape[1]
    )
    return heads_to_seq(out.transpose(1, 2), group), None


def attach(model: torch.nn.Module, group: Any) -> None:
    """Record the sequence-parallel process `group` on a transformers causal LM (in place) and
    register `attention` with transformers."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, attention)
    model._ulysses_group = group


def group_of(module: torch.nn.Module) -> Any:
    """The group `attach` recorded on `module` (or on what a wrapper holds), else None."""
    return getattr(module, "_ulysses_group", None)


@contextlib.contextmanager
def ulysses_attention(model: torch.nn.Module) -> Iterator[Any]:
    """Run `model`'s attention layers through `attention` (its config's attention implementation
    switched and restored); yields the group."""
    group = group_of(model)
    config = model.config
    saved = config._attn_implementation
    token = _GROUP.set(group)
    config._attn_implementation = ATTENTION
    try:
        yield group
    finally:
        config._attn_implementation = saved
        _GROUP.reset(token)
