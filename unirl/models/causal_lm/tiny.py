"""Tiny text models built in code from a config, no files and no hub: the byte-level tokenizers,
tiny random Qwen3 / Qwen2 causal LMs (`TinyLMConfig`) and Qwen2.5-VL / Qwen3-VL vision-language
models (`TinyVLMConfig`) with their image processor.

Shared by the text families (`unirl.models.qwen`, `unirl.models.qwen_vl`, Janus's tokenizer) and by
the diffusion families whose text encoder is one of these models (Qwen-Image's Qwen2.5-VL, the
chat template of Z-Image's, FLUX.2's and HunyuanVideo's encoders), as `flow/loading.py` holds the
tiny CLIP / T5 builders the diffusion families share.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers import (
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from unirl.types.constraints import AtLeastOne, check_fields

_ARCHITECTURES = {"qwen3": (Qwen3Config, Qwen3ForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM)}
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
# ChatML, as Qwen's templates render it (no system prompt is added)
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}"
)


VISION_START, IMAGE_PAD, VISION_END, VIDEO_PAD = (
    "<|vision_start|>",
    "<|image_pad|>",
    "<|vision_end|>",
    "<|video_pad|>",
)
VISION_TOKENS = (VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD)


def fast_tokenizer(tok, extra_special: tuple[str, ...] = (), **options) -> PreTrainedTokenizerFast:
    """The `PreTrainedTokenizerFast` over a `tokenizers.Tokenizer` built in code (the tiny
    tokenizers): `SPECIAL_TOKENS` (`<|endoftext|>`, EOS and pad, `<|im_start|>`, `<|im_end|>`) and
    `extra_special` (e.g. a VLM's vision tokens) added to `tok` as special tokens, each one token,
    the ones after EOS as `additional_special_tokens`; no clean-up of tokenization spaces.
    `options` are further `PreTrainedTokenizerFast` arguments (e.g. `chat_template`)."""
    from tokenizers import AddedToken

    special = (*SPECIAL_TOKENS, *extra_special)
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        additional_special_tokens=list(special[1:]),
        clean_up_tokenization_spaces=False,
        **options,
    )


def tiny_tokenizer(extra_special: tuple[str, ...] = ()) -> PreTrainedTokenizerFast:
    """A byte-level tokenizer built in code: every byte is one token (printable ASCII
    characters map to themselves), then `<|endoftext|>` (EOS and pad),
    `<|im_start|>`, `<|im_end|>` and `extra_special` (e.g. a VLM's vision tokens), each
    one token; a ChatML chat template. Decoding gives the text back."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={ch: i for i, ch in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    return fast_tokenizer(tok, extra_special, chat_template=CHAT_TEMPLATE)


@dataclass
class TinyLMConfig:
    """A tiny random causal LM for CPU runs and tests.

    `architecture` is "qwen3" (per-head q/k RMSNorm) or "qwen2" (qkv biases).
    The head dim is `hidden_size // num_attention_heads`; the vocabulary is
    the tiny byte-level tokenizer's (256 bytes + 3 special tokens). Weights
    are drawn under `seed` without touching the global RNG. Embeddings are
    untied by default: a random model with tied ones mostly echoes its last
    input token under greedy decoding, which makes a poor test subject.
    """

    architecture: str = "qwen3"
    hidden_size: AtLeastOne = 64
    num_layers: AtLeastOne = 2
    num_attention_heads: AtLeastOne = 4
    num_key_value_heads: AtLeastOne = 2
    intermediate_size: AtLeastOne = 128
    max_position_embeddings: AtLeastOne = 512
    tie_word_embeddings: bool = False
    seed: int = 0

    def __post_init__(self) -> None:
        if self.architecture not in _ARCHITECTURES:
            raise ValueError(
                f"model.tiny.architecture must be one of {sorted(_ARCHITECTURES)}, got {self.architecture!r}"
            )
        check_fields(self, "model.tiny.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"model.tiny.hidden_size={self.hidden_size} must be a multiple of "
                f"model.tiny.num_attention_heads={self.num_attention_heads}"
            )
        if (self.hidden_size // self.num_attention_heads) % 2:
            raise ValueError(
                f"model.tiny head dim hidden_size / num_attention_heads = "
                f"{self.hidden_size // self.num_attention_heads} must be even (rotary embeddings)"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"model.tiny.num_attention_heads={self.num_attention_heads} must be a multiple of "
                f"model.tiny.num_key_value_heads={self.num_key_value_heads}"
            )


def tiny_lm_model(
    cfg: TinyLMConfig, tokenizer: PreTrainedTokenizerFast, dtype: torch.dtype = torch.float32
) -> PreTrainedModel:
    """A randomly initialized tiny Qwen3 / Qwen2 causal LM over `tokenizer`'s vocabulary (its EOS is
    BOS, EOS and pad), deterministic in `cfg.seed`."""
    config_cls, model_cls = _ARCHITECTURES[cfg.architecture]
    config = config_cls(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.hidden_size // cfg.num_attention_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = model_cls(config).to(dtype)
    return model


def _tiny_architectures() -> dict[str, tuple[type, type]]:
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
    )

    return {
        "qwen2_5_vl": (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration),
        "qwen3_vl": (Qwen3VLConfig, Qwen3VLForConditionalGeneration),
    }


TINY_VLM_ARCHITECTURES = ("qwen2_5_vl", "qwen3_vl")


@dataclass
class TinyVLMConfig(TinyLMConfig):
    """A tiny random VLM: the text decoder of `TinyLMConfig` plus a vision tower.

    `architecture` is "qwen2_5_vl" or "qwen3_vl". An image becomes patches of
    `patch_size` pixels (and `temporal_patch_size` frames: a still image is
    repeated); `spatial_merge_size`^2 patches merge into one LM token, so an
    image of H x W pixels (resized by the processor to multiples of
    patch_size * spatial_merge_size within [min_pixels, max_pixels]) costs
    H W / (patch_size * spatial_merge_size)^2 tokens.
    """

    architecture: str = "qwen2_5_vl"
    vision_depth: AtLeastOne = 2
    vision_hidden_size: AtLeastOne = 32
    vision_intermediate_size: AtLeastOne = 64
    vision_num_heads: AtLeastOne = 2
    patch_size: AtLeastOne = 14
    spatial_merge_size: AtLeastOne = 2
    temporal_patch_size: AtLeastOne = 2
    min_pixels: AtLeastOne = 28 * 28
    max_pixels: int = 28 * 28 * 16
    max_position_embeddings: AtLeastOne = 1024

    def __post_init__(self) -> None:
        if self.architecture not in TINY_VLM_ARCHITECTURES:
            raise ValueError(
                f"model.tiny.architecture must be one of {list(TINY_VLM_ARCHITECTURES)}, "
                f"got {self.architecture!r}"
            )
        arch, self.architecture = self.architecture, "qwen3"  # the decoder's checks are TinyLMConfig's
        try:
            super().__post_init__()
        finally:
            self.architecture = arch
        if self.vision_hidden_size % self.vision_num_heads:
            raise ValueError(
                f"model.tiny.vision_hidden_size={self.vision_hidden_size} must be a multiple of "
                f"model.tiny.vision_num_heads={self.vision_num_heads}"
            )
        if self.max_pixels < self.min_pixels:
            raise ValueError(
                f"model.tiny.max_pixels={self.max_pixels} must be >= model.tiny.min_pixels={self.min_pixels}"
            )
        head = self.hidden_size // self.num_attention_heads
        if head % 8:
            raise ValueError(
                f"model.tiny head dim hidden_size / num_attention_heads = {head} must be a multiple of 8 "
                "(the multimodal rotary sections split head_dim / 2 into temporal, height and width)"
            )


def _mrope_section(head_dim: int) -> list[int]:
    """Split head_dim / 2 rotary frequencies into (temporal, height, width) sections, as
    Qwen's 1:1.5:1.5 split (16, 24, 24 of 64) does."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def tiny_vlm_model(cfg: TinyVLMConfig, vocab_size: int, token_ids: dict[str, int]) -> PreTrainedModel:
    """A randomly initialized tiny VLM, deterministic in `cfg.seed`."""
    config_cls, model_cls = _tiny_architectures()[cfg.architecture]
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rope = {"rope_type": "default", "mrope_section": _mrope_section(head_dim), "rope_theta": 10000.0}
    if cfg.architecture == "qwen3_vl":
        rope["mrope_interleaved"] = True
    text = dict(
        vocab_size=vocab_size,
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        head_dim=head_dim,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_parameters=rope,
        bos_token_id=token_ids["eos"],
        eos_token_id=token_ids["eos"],
        pad_token_id=token_ids["eos"],
    )
    vision = dict(
        depth=cfg.vision_depth,
        hidden_size=cfg.vision_hidden_size,
        intermediate_size=cfg.vision_intermediate_size,
        num_heads=cfg.vision_num_heads,
        out_hidden_size=cfg.hidden_size,
        patch_size=cfg.patch_size,
        spatial_merge_size=cfg.spatial_merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
    )
    if cfg.architecture == "qwen2_5_vl":
        vision.update(fullatt_block_indexes=[cfg.vision_depth - 1], window_size=cfg.patch_size * 4)
    else:
        vision.update(deepstack_visual_indexes=[], num_position_embeddings=64)
    config = config_cls(
        text_config=text,
        vision_config=vision,
        image_token_id=token_ids[IMAGE_PAD],
        video_token_id=token_ids[VIDEO_PAD],
        vision_start_token_id=token_ids[VISION_START],
        vision_end_token_id=token_ids[VISION_END],
        tie_word_embeddings=cfg.tie_word_embeddings,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return model_cls(config)


def tiny_image_processor(cfg: TinyVLMConfig) -> Any:
    """The Qwen2-VL image processor (PIL backend when torchvision is absent) at the tiny sizes."""
    try:
        import torchvision  # noqa: F401
        from transformers import Qwen2VLImageProcessor as processor_cls
    except ImportError:
        from transformers import Qwen2VLImageProcessorPil as processor_cls
    return processor_cls(
        patch_size=cfg.patch_size,
        merge_size=cfg.spatial_merge_size,
        temporal_patch_size=cfg.temporal_patch_size,
        min_pixels=cfg.min_pixels,
        max_pixels=cfg.max_pixels,
    )
