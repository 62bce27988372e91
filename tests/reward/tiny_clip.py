"""A tiny random CLIP saved in the upstream layout (a `CLIPModel` and its `CLIPProcessor` in one
directory), for the CLIP-based scorers' tests."""

from __future__ import annotations

import torch

from unirl.models.flow.loading import tiny_clip_t5_tokenizers

SIZE = 32  # the processor's resize / crop and the vision tower's image size


def save_tiny_clip(path, projection_dim: int = 16):
    """Write the tiny CLIP (seeded) to `path`; returns `path`."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPProcessor

    tokenizer, _ = tiny_clip_t5_tokenizers(77, 8)
    torch.manual_seed(0)
    config = CLIPConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "intermediate_size": 64,
                     "num_hidden_layers": 2, "num_attention_heads": 2, "max_position_embeddings": 77,
                     "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 1},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "image_size": SIZE, "patch_size": 8},
        projection_dim=projection_dim,
    )  # fmt: skip
    CLIPModel(config).eval().save_pretrained(path)
    processor = CLIPProcessor(
        image_processor=CLIPImageProcessor(
            size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}
        ),
        tokenizer=tokenizer,
    )
    processor.save_pretrained(path)
    return path
