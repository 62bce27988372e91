"""The Janus family's model config: which Janus to build, as data (`TinyJanusConfig`, the tiny
model's geometry; `JanusModelConfig`, the recipe's `model` node), the tokens its tokenizer adds,
and the checks it answers before Ray (directory, plan length against the context, stop tokens).
It names its modeling module (`bundle.py`) only inside the calls that build.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import ClassVar

from transformers import JanusConfig

from unirl.models.causal_lm.loading import TransformersFamilyConfig
from unirl.models.causal_lm.tiny import tiny_tokenizer
from unirl.types.constraints import AtLeastOne, check_fields

BOI_TOKEN = "<begin_of_image>"
EOI_TOKEN = "<end_of_image>"
IMAGE_TOKEN = "<image_placeholder>"
PLAN_END_TOKEN = "<end_of_plan>"  # the tiny tokenizer's plan stop token (one token)
JANUS_TOKENS = (BOI_TOKEN, EOI_TOKEN, IMAGE_TOKEN, PLAN_END_TOKEN)


@dataclass
class TinyJanusConfig:
    """A tiny random Janus for CPU runs and tests.

    Attributes:
        hidden_size, num_layers, num_attention_heads, num_key_value_heads, intermediate_size,
            max_position_embeddings: the Llama backbone (head dim hidden / heads, even).
        num_patches: the VQ latent grid side; an image is `num_patches ** 2` tokens.
        codebook_size: VQ codebook entries (the image head's vocabulary).
        vq_levels: decoder resolutions; the image is `num_patches * 2 ** (vq_levels - 1)` px.
        vq_channels: the VQ-VAE's base channels (a multiple of 32: its GroupNorms).
        vq_embed_dim: codebook vector size.
        seed: weights are drawn under it without touching the global RNG.
    """

    hidden_size: AtLeastOne = 32
    num_layers: AtLeastOne = 1
    num_attention_heads: AtLeastOne = 2
    num_key_value_heads: AtLeastOne = 1
    intermediate_size: AtLeastOne = 64
    max_position_embeddings: AtLeastOne = 256
    num_patches: AtLeastOne = 4
    codebook_size: AtLeastOne = 32
    vq_levels: AtLeastOne = 3
    vq_channels: AtLeastOne = 32
    vq_embed_dim: AtLeastOne = 4
    seed: int = 0

    def __post_init__(self) -> None:
        check_fields(self, "model.tiny.")
        if self.hidden_size % self.num_attention_heads or (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(
                f"model.tiny.hidden_size={self.hidden_size} / num_attention_heads={self.num_attention_heads} "
                "must be an even whole head dim (rotary embeddings)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.tiny.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"num_key_value_heads={self.num_key_value_heads}"
            )
        if self.vq_channels % 32:
            raise ValueError(
                f"model.tiny.vq_channels must be a multiple of 32 (GroupNorm), got {self.vq_channels}"
            )

    @property
    def image_size(self) -> int:
        return self.num_patches * 2 ** (self.vq_levels - 1)

    def janus_config(self, vocab_size: int, image_token_id: int) -> JanusConfig:
        h = self.hidden_size
        text = {
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": h,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "max_position_embeddings": self.max_position_embeddings,
        }
        # the understanding tower is unused by generation; the smallest that builds (2 patches a
        # side), while JanusConfig derives the VQ grid from image_size / patch_size
        vision = {
            "hidden_size": 16,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 2 * self.num_patches,
            "patch_size": 2,
            "projection_dim": h,
            "num_image_tokens": self.num_patches**2,
            "mlp_ratio": 2.0,
        }
        vq = {
            "embed_dim": self.vq_embed_dim,
            "num_embeddings": self.codebook_size,
            "latent_channels": self.vq_channels,
            "base_channels": self.vq_channels,
            "channel_multiplier": [1] * self.vq_levels,
            "num_res_blocks": 1,
            "projection_dim": h,
            "image_token_embed_dim": h,
            "num_hidden_layers": 1,
        }
        return JanusConfig(
            text_config=text,
            vision_config=vision,
            vq_config=vq,
            image_token_id=image_token_id,
            tie_word_embeddings=False,
        )


@dataclass
class JanusModelConfig(TransformersFamilyConfig):
    """Which Janus to build (exactly one of `pretrained_path` / `tiny`).

    Attributes:
        pretrained_path: local Hugging Face Janus directory (model and tokenizer).
    """

    modality: ClassVar[str] = "unified"
    MODELING: ClassVar[str] = "unirl.models.janus.bundle"
    BUNDLE: ClassVar[str] = "JanusBundle"
    TINY: ClassVar[type] = TinyJanusConfig
    WHAT: ClassVar[str] = "Janus"
    MODEL_CLASS: ClassVar[str] = "JanusForConditionalGeneration"
    CONFIG_CLASS: ClassVar[str] = "JanusConfig"

    tiny: TinyJanusConfig | None = None

    def text_problems(self, sampling) -> list[str]:
        """The plan's sampling vs this model, as `sampling.<key>: ...` problems: prompt + plan +
        BOI + the image tokens fit the context, and each stop token is one token."""
        if self.pretrained_path is not None:
            if self.directory_problems():
                return []  # reported by directory_problems
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.pretrained_path, local_files_only=True)
            config = JanusConfig.from_pretrained(self.pretrained_path, local_files_only=True)
            context = config.text_config.max_position_embeddings
            image_tokens = config.vq_config.num_patches**2
        else:
            tokenizer = tiny_tokenizer(JANUS_TOKENS)
            context, image_tokens = self.tiny.max_position_embeddings, self.tiny.num_patches**2
        problems = []
        need = sampling.max_prompt_length + sampling.max_new_tokens + 1 + image_tokens
        if need > context:
            problems.append(
                f"sampling.max_prompt_length ({sampling.max_prompt_length}) + max_new_tokens "
                f"({sampling.max_new_tokens}) + BOI + {image_tokens} image tokens = {need} exceeds the model's "
                f"max_position_embeddings={context}"
            )
        for s in sampling.stop_tokens:
            ids = tokenizer.encode(s, add_special_tokens=False)
            if len(ids) != 1:
                problems.append(
                    f"sampling.stop_tokens: {s!r} is {len(ids)} tokens of this model's tokenizer; each stop token "
                    f"must be one token (the tiny tokenizer's plan stop token is {PLAN_END_TOKEN!r})"
                )
        return problems

    def directory_problems(self) -> list[str]:
        """`pretrained_path`, when set, is a directory whose config.json is a Janus model's."""
        path = self.pretrained_path
        if not path:
            return []
        config = os.path.join(path, "config.json")
        if not os.path.isfile(config):
            return [
                f"model.pretrained_path: {path!r} has no config.json; point it at a local Janus directory "
                "(transformers' JanusForConditionalGeneration format) or set it to null to use model.tiny"
            ]
        with open(config) as f:
            model_type = json.load(f).get("model_type")
        if model_type != "janus":
            return [
                f"model.pretrained_path: {path!r} holds a {model_type!r} model, not a Janus "
                "(config.json model_type 'janus')"
            ]
        return []
