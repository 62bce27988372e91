"""SD3's joint attention under Ulysses sequence parallelism, which diffusers does not plan for SD3
(`SD3Transformer2DModel` has no `_cp_plan`, and `JointAttnProcessor2_0` calls SDPA directly).

`prepare_transformer` gives an SD3 transformer the plan and the processor below. The plan splits
the image tokens into P shards at the first block and gathers them at `proj_out`, as diffusers'
plans for FLUX.1 and Wan do; the text tokens are not split (SD3's 77 CLIP + 256 T5 = 333 tokens
divide by no even degree), so every rank of a group runs the whole text stream. Inside each joint
attention a rank takes the image queries, keys and values of every token for its H / P heads
(an all-to-all), and the same H / P heads of the text ones (a slice), attends over the joint
sequence, sends the image outputs back to their token shards (the inverse all-to-all) and joins
the text outputs of all heads (an all-gather whose backward sums the copies' gradients). Without
a parallel config (or with degree 1) the processor is diffusers' `JointAttnProcessor2_0`, bit for
bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput
from diffusers.models.attention_processor import JointAttnProcessor2_0

from unirl.models.ulysses import gather_heads, heads_to_seq, own_heads, seq_to_heads

SD3_CP_PLAN = {
    "transformer_blocks.0": {
        "hidden_states": ContextParallelInput(split_dim=1, expected_dims=3, split_output=False),
    },
    "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
}


class UlyssesJointAttnProcessor(JointAttnProcessor2_0):
    """`JointAttnProcessor2_0` (joint image + text attention, and SD3.5's image-only `attn2`) that
    runs Ulysses when `unirl.train.sequence_parallel.enable_ulysses` sets its `_parallel_config`
    (a diffusers `ParallelConfig`): image tokens arrive as this rank's shard [B, S/P, dim], text
    tokens whole [B, T, dim] on every rank of the group."""

    _parallel_config = None

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, *args, **kwargs):
        cp = getattr(self._parallel_config, "context_parallel_config", None)
        if cp is None or cp.ulysses_degree == 1:
            return super().__call__(
                attn, hidden_states, encoder_hidden_states, attention_mask, *args, **kwargs
            )
        if attention_mask is not None:
            raise ValueError("SD3's joint attention under sequence parallelism takes no attention mask")
        group = cp._ulysses_mesh.get_group()
        batch, local_tokens = hidden_states.shape[:2]

        def split_heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, x.shape[1], attn.heads, -1)

        query, key, value = (split_heads(p(hidden_states)) for p in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        query, key, value = (seq_to_heads(t, group) for t in (query, key, value))
        image_tokens = query.shape[1]
        if encoder_hidden_states is not None:
            text = [
                split_heads(p(encoder_hidden_states))
                for p in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj)
            ]
            if attn.norm_added_q is not None:
                text[0] = attn.norm_added_q(text[0])
            if attn.norm_added_k is not None:
                text[1] = attn.norm_added_k(text[1])
            query, key, value = (
                torch.cat([image, own_heads(t, group)], dim=1)
                for image, t in zip((query, key, value), text, strict=True)
            )
        out = (
            F.scaled_dot_product_attention(
                query.transpose(1, 2),
                key.transpose(1, 2),
                value.transpose(1, 2),
                dropout_p=0.0,
                is_causal=False,
            )
            .transpose(1, 2)
            .to(query.dtype)
        )
        image = heads_to_seq(out[:, :image_tokens], group).reshape(batch, local_tokens, -1)
        image = attn.to_out[1](attn.to_out[0](image))
        if encoder_hidden_states is None:
            return image
        context = gather_heads(out[:, image_tokens:], group).flatten(2)
        if not attn.context_pre_only:
            context = attn.to_add_out(context)
        return image, context


def prepare_transformer(transformer: torch.nn.Module) -> torch.nn.Module:
    """Give an SD3 transformer `SD3_CP_PLAN` and one `UlyssesJointAttnProcessor` for all its
    attention layers (in place; returns it). Sampling and training are unchanged until
    `enable_ulysses` applies the plan."""
    transformer._cp_plan = SD3_CP_PLAN
    transformer.set_attn_processor(UlyssesJointAttnProcessor())
    return transformer
