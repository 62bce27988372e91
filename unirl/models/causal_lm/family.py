"""What a text family gives the shared text stage (`CausalLMStage`): the contract a causal-LM
bundle implements, as `unirl.models.flow.family.FlowFamily` is the diffusion families' one.

Structural typing (no base class to inherit): `CausalLMBundle` (Qwen3 / Qwen2 / Llama),
`VLMBundle` (Qwen2.5-VL / Qwen3-VL) and `JanusBundle` (Janus's text side) satisfy it, and a new
text family is a bundle with these members. The stage checks a bundle against it when built
(`text_family_problems`), so a bundle that lacks a member is refused naming it, not failed on
deep inside a rollout.

Shapes: B samples, L tokens, N image patches of a sample, D the flattened patch length, k the
sample's images.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch


@runtime_checkable
class TextFamily(Protocol):
    """A causal LM and its tokenizer, as the text stage reads them.

    - `model`: the Hugging Face causal LM (its `config.get_text_config()` holds
      `max_position_embeddings`; `get_input_embeddings()` its vocabulary rows); the train
      backend wraps it (LoRA / FSDP2) in place of the stage's `module`.
    - `tokenizer`: a fast tokenizer with `eos_token_id` (ends a response) and `pad_token_id`
      (pads a batch) set, and a chat template when recipes ask for one.
    - `has_vision`: whether prompts may carry images (then the bundle is a `VisionTextFamily`).
    - `vision_token_ids`: token ids a response must never hold (a VLM's image placeholders, a
      unified model's image delimiters), masked out of sampling; () for a text-only model.
    """

    model: torch.nn.Module
    tokenizer: Any
    has_vision: bool
    vision_token_ids: tuple[int, ...] | list[int]


@runtime_checkable
class VisionTextFamily(TextFamily, Protocol):
    """A text family whose prompts carry images (`has_vision` True).

    - `prepare(prompt, images, sample_id) -> (text, pixel_values [N, D] fp32, grids [k, 3] long)`:
      the prompt with each image placeholder expanded into the model's vision tokens; raises
      naming `sample_id` when placeholders and images disagree in number.
    - `positions(input_ids [B, L], attention_mask [B, L], image_grid_thw [sum k, 3] | None)`:
      the forward's rotary `position_ids` (Qwen-VL's [3, B, L] multimodal positions).
    - `vision_inputs(pixel_values per row, grids per row, device) -> dict`: the forward's image
      keyword arguments for a batch, {} when no row has an image.
    """

    def prepare(
        self, prompt: str, images: list[Any], sample_id: str
    ) -> tuple[str, torch.Tensor, torch.Tensor]: ...

    def positions(
        self, input_ids: torch.Tensor, attention_mask: torch.Tensor, image_grid_thw: torch.Tensor | None
    ) -> torch.Tensor: ...

    def vision_inputs(
        self, pixel_values: list[torch.Tensor], image_grid_thw: list[torch.Tensor], device: Any
    ) -> dict: ...


TEXT_MEMBERS = ("model", "tokenizer", "has_vision", "vision_token_ids")
VISION_MEMBERS = ("prepare", "positions", "vision_inputs")


def text_family_problems(bundle: Any) -> list[str]:
    """The members of `TextFamily` (and of `VisionTextFamily` when `bundle.has_vision`) that
    `bundle` lacks, each named with the class; [] when it satisfies the contract."""
    name = type(bundle).__name__
    missing = [m for m in TEXT_MEMBERS if not hasattr(bundle, m)]
    if getattr(bundle, "has_vision", False):
        missing += [m for m in VISION_MEMBERS if not callable(getattr(bundle, m, None))]
    return [
        f"{name} lacks `{m}`, which the text stage calls (unirl.models.causal_lm.family."
        f"{'VisionTextFamily' if m in VISION_MEMBERS else 'TextFamily'})"
        for m in missing
    ]
