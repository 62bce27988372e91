"""The Janus bundle: one transformers `JanusForConditionalGeneration` (a Llama backbone that
reads text tokens and VQ image tokens in one sequence, its text head, its image-generation
embedding / aligner / head and its VQ-VAE decoder) and its tokenizer.

Two ways to build one, same code path afterwards:
- `JanusModelConfig(pretrained_path=<dir>)`: a local Hugging Face Janus directory (Janus-Pro
  converted to transformers' format: `config.json`, weights, tokenizer files), read with
  `local_files_only`.
- `JanusModelConfig(tiny=TinyJanusConfig(...))`: a tiny random Janus built from a config, with
  the byte-level tokenizer of `unirl.models.causal_lm.tiny.tiny_tokenizer` plus Janus's image tokens.

`save_pretrained(dir)` writes model and tokenizer so that `JanusModelConfig(pretrained_path=dir)`
loads them back offline. Image geometry: `num_image_tokens = num_patches ** 2` codebook indices
per image, row-major over the VQ latent grid; `image_size = num_patches * 2 ** (levels - 1)`
pixels a side.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from transformers import JanusForConditionalGeneration

from unirl.models.causal_lm.family import TextBundle
from unirl.models.causal_lm.tiny import tiny_tokenizer
from unirl.models.janus.config import (
    BOI_TOKEN,
    EOI_TOKEN,
    IMAGE_TOKEN,
    JANUS_TOKENS,
    TinyJanusConfig,
)


class JanusBundle(TextBundle):
    """A Janus model and its tokenizer: a text family (the text stage, `CausalLMStage`, runs on
    it as on any causal LM: `model(input_ids=...)` gives text logits) and an image-token family
    (`unirl.models.image_tokens.VQImageStage` draws its image tokens).

    Attributes:
        model: the `JanusForConditionalGeneration`.
        tokenizer: its fast tokenizer (EOS ends a plan; `pad_token_id` fills the unconditional
            rows of classifier-free guidance, as Janus does).
        boi_token_id: `<begin_of_image>`, the last token of every image context.
        vision_token_ids: image tokens of the text vocabulary, which a plan never samples.
        num_image_tokens, codebook_size, image_size: the image geometry.
    """

    auto_model: ClassVar[type] = JanusForConditionalGeneration
    # what no loss of a unified run reaches: the VQ-VAE (decode runs without gradient) and the
    # understanding tower (no image inputs); the train backend leaves them frozen
    frozen_modules: ClassVar[tuple[str, ...]] = ("vqmodel", "vision_model", "aligner")
    # with several ranks, each submodule a stage calls is an FSDP root of its own, beside the decoder
    # layers (`train.fsdp.block_classes`, roots too: no unit holds them): the image stage embeds
    # text with embed_tokens outside language_model's forward, so language_model cannot be a unit
    fsdp_roots: ClassVar[tuple[str, ...]] = (
        "language_model.embed_tokens", "language_model.norm", "lm_head",
        "generation_embeddings", "generation_aligner", "generation_head",
    )  # fmt: skip

    def __init__(self, model, tokenizer, where: str) -> None:
        super().__init__(model, tokenizer, where)
        vocab = tokenizer.get_vocab()
        missing = [t for t in (BOI_TOKEN, EOI_TOKEN) if t not in vocab]
        if missing:
            raise ValueError(f"{where}: the tokenizer has no {missing} token(s); Janus's tokenizer has both")
        self.boi_token_id = vocab[BOI_TOKEN]
        self.vision_token_ids = [vocab[BOI_TOKEN], vocab[EOI_TOKEN], int(model.config.image_token_id)]
        quantize = model.model.vqmodel.quantize
        self.num_image_tokens = int(quantize.quant_state_dims[0] * quantize.quant_state_dims[1])
        self.codebook_size = int(quantize.num_embeddings)
        levels = len(model.config.vq_config.channel_multiplier)
        self.image_size = int(quantize.quant_state_dims[0] * 2 ** (levels - 1))

    @classmethod
    def tiny(cls, cfg: TinyJanusConfig, dtype: torch.dtype = torch.float32) -> JanusBundle:
        """A randomly initialized tiny Janus, deterministic in `cfg.seed`."""
        tokenizer = tiny_tokenizer(JANUS_TOKENS)
        config = cfg.janus_config(len(tokenizer), tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))
        config.text_config.eos_token_id = config.text_config.pad_token_id = tokenizer.eos_token_id
        config.text_config.bos_token_id = tokenizer.eos_token_id
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(cfg.seed)
            model = JanusForConditionalGeneration(config).to(dtype)
        return cls(model, tokenizer, where="model.tiny")

    # ---- the image-token family (unirl.models.image_tokens.family.ImageTokenFamily) ------------
    @property
    def uncond_keep_ids(self) -> list[int]:
        """BOS and BOI: Janus's unconditional context pads every other token."""
        return [i for i in (self.tokenizer.bos_token_id, self.boi_token_id) if i is not None]

    @staticmethod
    def backbone(model: torch.nn.Module) -> torch.nn.Module:
        """The Llama decoder that reads text and image positions in one sequence."""
        return model.model.language_model

    @staticmethod
    def embed_text(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
        return model.get_input_embeddings()(ids)

    @staticmethod
    def embed_image(model: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        """`generation_embeddings` + `generation_aligner` of codebook indices."""
        return model.prepare_embeddings_for_image_generation(tokens)

    @staticmethod
    def image_logits(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
        """`generation_head`: hidden states to logits over the codebook."""
        return model.model.generation_head(hidden)

    def decode(self, image_tokens: torch.Tensor) -> torch.Tensor:
        """[B, 3, S, S] uint8 images of codebook indices [B, num_image_tokens]: the library's
        `decode_image_tokens` (VQ-VAE decode), then its image processor's postprocess
        (unnormalize mean 0.5 / std 0.5, x 255, clip, truncate to uint8)."""
        with torch.no_grad():
            pixels = self.model.decode_image_tokens(image_tokens).float()  # [B, S, S, 3] in ~[-1, 1]
        out = ((pixels * 0.5 + 0.5) * 255).clamp(0, 255).to(torch.uint8)
        return out.permute(0, 3, 1, 2).contiguous()
