"""What an image-token family gives the shared image-token stage (`VQImageStage`): the contract
a unified model's bundle implements, as `unirl.models.flow.family.FlowFamily` is the diffusion
families' and `unirl.models.causal_lm.family.TextFamily` the text families'.

An image-token model draws an image as N codebook indices of a VQ tokenizer, one at a time after
a text context, from the same causal backbone that writes text: text positions are embedded by
the text embeddings, image positions by the family's image embeddings, and the hidden state of a
position goes through the family's image head to logits over the K codebook entries.

Structural typing (no base class to inherit): `unirl.models.janus.JanusBundle` satisfies it, and
a new unified family is a bundle with these members. The stage checks a bundle against it when
built (`image_token_family_problems`), naming what is missing.

Shapes: N image tokens, K codebook entries, D hidden, S pixels a side; `model` arguments are the
unwrapped model (the stage strips a peft wrapper; LoRA layers sit inside it).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class ImageTokenFamily(Protocol):
    """A unified model, its tokenizer and its image geometry, as the image-token stage reads them.

    - `model`: the module the train backend wraps (LoRA / FSDP2) in place of the stage's `module`.
    - `tokenizer`: its `pad_token_id` fills the unconditional rows of classifier-free guidance.
    - `boi_token_id`: the begin-of-image token, the last token of every image context.
    - `uncond_keep_ids`: the token ids an unconditional context keeps (every other becomes pad).
    - `num_image_tokens` (N), `codebook_size` (K), `image_size` (S): the image geometry.
    - `backbone(model)`: the causal decoder called with `inputs_embeds`, `attention_mask`,
      `position_ids`, `past_key_values`, `use_cache`; its output has `last_hidden_state` [.., D].
    - `embed_text(model, ids [..]) -> [.., D]`, `embed_image(model, tokens [..]) -> [.., D]`.
    - `image_logits(model, hidden [.., D]) -> [.., K]`.
    - `decode(tokens [B, N]) -> [B, 3, S, S]` uint8 pixels (no gradient).
    """

    model: torch.nn.Module
    tokenizer: Any
    boi_token_id: int
    uncond_keep_ids: list[int]
    num_image_tokens: int
    codebook_size: int
    image_size: int

    def backbone(self, model: torch.nn.Module) -> torch.nn.Module: ...

    def embed_text(self, model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor: ...

    def embed_image(self, model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor: ...

    def image_logits(self, model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor: ...

    def decode(self, image_tokens: torch.Tensor) -> torch.Tensor: ...


DATA_MEMBERS = (
    "model", "tokenizer", "boi_token_id", "uncond_keep_ids", "num_image_tokens", "codebook_size", "image_size",
)  # fmt: skip
CALLED_MEMBERS = ("backbone", "embed_text", "embed_image", "image_logits", "decode")


def image_token_family_problems(bundle: Any) -> list[str]:
    """The members of `ImageTokenFamily` that `bundle` lacks (a method that is not callable
    counts as missing), each named with the class; [] when it satisfies the contract."""
    name = type(bundle).__name__
    missing = [m for m in DATA_MEMBERS if not hasattr(bundle, m)]
    missing += [m for m in CALLED_MEMBERS if not callable(getattr(bundle, m, None))]
    return [
        f"{name} lacks `{m}`, which the image-token stage calls (unirl.models.image_tokens.family.ImageTokenFamily)"
        for m in missing
    ]
