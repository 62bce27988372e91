"""What flow-matching families share to load, build and export: the scheduler options the pinned
sigma schedules reproduce, the tiny CLIP / T5 tokenizers built in code (no files, no hub), the
VAE decode with scaling and shift (`vae_pixels`), and the diffusers weight export
(`write_diffusers_weights`), and the checkpoint load (`load_diffusers_checkpoint`)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING, Any

from unirl.models.source import missing_directory_problems, read_checkpoint_meta
from unirl.sde.schedules import NUM_TRAIN_TIMESTEPS

if TYPE_CHECKING:
    from collections.abc import Callable

    import torch


def vae_pixels(vae, latents):
    """[B, 3, H, W] fp32 RGB in about [-1, 1] (unclamped), differentiable: the VAE decode of
    latents / scaling_factor + shift_factor, or the latents themselves in pixel space (vae None)."""
    if vae is None:
        return latents.float()
    scaled = latents.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    return vae.decode(scaled, return_dict=False)[0].float()


def latents_mean_std_decode(vae, latents):
    """The decode of a VAE that normalizes its latents per channel by a fixed mean / std (Wan's
    `AutoencoderKLWan`, Qwen-Image's `AutoencoderKLQwenImage`): `vae.decode(latents / (1 /
    latents_std) + latents_mean)` in the VAE's dtype, written as WanPipeline / QwenImagePipeline
    write it (bit for bit), from video latents [B, C, f, h, w]; returns the decoder's output
    [B, 3, F, H, W] in the VAE's dtype, differentiable (the caller picks frames and casts)."""
    import torch

    c = vae.config.z_dim
    latents = latents.to(vae.dtype)
    mean = torch.tensor(vae.config.latents_mean).view(1, c, 1, 1, 1).to(latents.device, latents.dtype)
    inv_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, c, 1, 1, 1).to(latents.device, latents.dtype)
    return vae.decode(latents / inv_std + mean, return_dict=False)[0]


def pretrained_pipeline_options(path: str) -> dict:
    """The checks and options every family's `from_pretrained` starts with: `path` must be a
    directory (FileNotFoundError naming `model.pretrained_path`), and a directory without `vae/`
    is a pixel-space model, loaded with `vae=None` (returned as the pipeline's extra
    `from_pretrained` keywords: {} or {"vae": None})."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"model.pretrained_path {path!r} is not a directory")
    return {} if os.path.isdir(os.path.join(path, "vae")) else {"vae": None}


LORA_WEIGHTS = "pytorch_lora_weights.safetensors"
"""The file a diffusers LoRA export writes (`save_lora_weights`) and its loaders read."""


def load_diffusers_checkpoint(path: str, from_pretrained: Callable[[str], Any], transformer_cls: type):
    """The bundle of a UniRL checkpoint directory of a diffusers family: `from_pretrained(base)`
    of its `base_model` (`unirl.models.source.read_checkpoint_meta`; FileNotFoundError when `path`
    is no checkpoint), then the trained weights: a LoRA through the pipeline's
    `load_lora_weights(path)` (a pipeline without one: the transformer's `load_lora_adapter`), or a
    full `transformer/` directory of `transformer_cls`, which
    replaces the bundle's and its pipeline's transformer."""
    meta = read_checkpoint_meta(path)
    bundle = from_pretrained(meta["base_model"])
    if meta["kind"] == "lora" and hasattr(bundle.pipeline, "load_lora_weights"):
        bundle.pipeline.load_lora_weights(path)
    elif meta["kind"] == "lora":  # a pipeline without a LoRA loader (HunyuanVideo 1.5): its transformer's
        bundle.transformer.load_lora_adapter(path, weight_name=LORA_WEIGHTS, prefix="transformer")
    else:
        transformer = transformer_cls.from_pretrained(os.path.join(path, "transformer"))
        bundle.pipeline.transformer = bundle.transformer = transformer
    return bundle


# FlowMatchEulerDiscreteScheduler options whose schedule unirl.sde.schedules does not compute
_SCHEDULER_REFUSED = (
    "shift_terminal",
    "use_karras_sigmas",
    "use_exponential_sigmas",
    "use_beta_sigmas",
    "invert_sigmas",
)


def check_scheduler_config(config: dict, where: str, reproduced: tuple[str, ...] = ()) -> None:
    """Raise if a scheduler config asks for a schedule `unirl.sde.schedules` does not
    reproduce (other training timesteps, terminal stretch, Karras/beta sigmas, ...). `reproduced`
    names options the family's recipes set as sampling keys instead (Qwen-Image: `shift_terminal`,
    `sampling.shift_terminal`), as they set the shift."""
    bad = {k: config[k] for k in _SCHEDULER_REFUSED if config.get(k) and k not in reproduced}
    if config.get("num_train_timesteps", NUM_TRAIN_TIMESTEPS) != NUM_TRAIN_TIMESTEPS:
        bad["num_train_timesteps"] = config["num_train_timesteps"]
    if config.get("time_shift_type", "exponential") != "exponential":
        bad["time_shift_type"] = config["time_shift_type"]
    if bad:
        raise ValueError(
            f"{where}/scheduler_config.json sets {bad}: UniRL's sigma schedules (unirl.sde.schedules) "
            f"reproduce FlowMatchEulerDiscreteScheduler with num_train_timesteps={NUM_TRAIN_TIMESTEPS}, "
            "exponential time shift and none of these options; remove them or add the schedule there"
        )


def pipeline_directory_problems(path: str | None, pipeline_class: str, family: str) -> list[str]:
    """`model.pretrained_path`, when set, is a directory whose `model_index.json` (if readable)
    names `pipeline_class`: one problem naming the key and the class found, else []."""
    if not path:
        return []
    if not os.path.isdir(path):
        return missing_directory_problems(path, f"diffusers {family}")
    index = os.path.join(path, "model_index.json")
    try:
        with open(index) as f:
            name = json.load(f).get("_class_name")
    except (OSError, ValueError):
        return []  # no readable index: from_pretrained reports what is missing
    if name != pipeline_class:
        return [
            f"model.pretrained_path: {index} names {name!r}, not {pipeline_class}: the directory is not "
            f"a {family} model; use that family's model config or point it at a {family} directory"
        ]
    return []


def _bpe(pieces: list[str], ranks: dict[tuple[str, str], int]) -> list[str]:
    """Byte-pair encoding of one word: repeatedly merge the adjacent pair of lowest rank."""
    while len(pieces) > 1:
        pairs = [
            (ranks.get((a, b), len(ranks)), i)
            for i, (a, b) in enumerate(zip(pieces, pieces[1:], strict=False))
        ]
        rank, i = min(pairs)
        if rank == len(ranks):
            break
        pieces = pieces[:i] + [pieces[i] + pieces[i + 1]] + pieces[i + 2 :]
    return pieces


def _whole_word_merges(words: list[str]) -> list[tuple[str, str]]:
    """CLIP-style BPE merges under which every word in `words` is one token.

    Each word gets merges appended (lowest priority) until BPE with all merges
    so far yields it whole; merges added later never fire on earlier words,
    because BPE only reaches a lower-priority merge when no higher one applies.
    """
    merges: list[tuple[str, str]] = []
    ranks: dict[tuple[str, str], int] = {}
    for word in dict.fromkeys(words):
        while len(pieces := _bpe([*word[:-1], word[-1] + "</w>"], ranks)) > 1:
            pair = (pieces[0], pieces[1])
            ranks[pair] = len(merges)
            merges.append(pair)
    return merges


def tiny_clip_t5_tokenizers(clip_max_length: int, t5_max_length: int, words: list[str] = ()):
    """(CLIPTokenizer, T5TokenizerFast) built in code, no files: a byte-level CLIP vocab and a
    character-level T5 unigram vocab, each word of `words` one whole token of both."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer, T5TokenizerFast

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    merges = _whole_word_merges(words)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    clip = CLIPTokenizer(vocab=vocab, merges=merges, model_max_length=clip_max_length)
    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    pieces += [(c, -1.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789\u2581.,'-"]
    pieces += [("\u2581" + w, -0.5) for w in dict.fromkeys(words)]
    t5 = T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=t5_max_length)
    return clip, t5


def tiny_clip_config(tokenizer, cfg, **extra):
    """The `CLIPTextConfig` of a tiny CLIP text encoder over `tokenizer` (`tiny_clip_t5_tokenizers`'
    CLIP: ids 0 / 1 are its start / end, 1 pads): `cfg.clip_hidden_size` wide (2 heads, MLP twice
    as wide), `cfg.text_layers` deep, `cfg.clip_max_length` positions; `extra` adds options (SD3's
    `projection_dim`). A config only: no weights, no random numbers drawn."""
    from transformers import CLIPTextConfig

    return CLIPTextConfig(
        vocab_size=len(tokenizer.get_vocab()),
        hidden_size=cfg.clip_hidden_size,
        intermediate_size=2 * cfg.clip_hidden_size,
        num_hidden_layers=cfg.text_layers,
        num_attention_heads=2,
        max_position_embeddings=cfg.clip_max_length,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=1,
        **extra,
    )


def tiny_t5_config(config_cls: type, tokenizer, hidden_size: int, num_layers: int, num_heads: int):
    """The config (`config_cls`: transformers' `T5Config`, or `UMT5Config` for Wan) of a tiny T5
    encoder over `tokenizer`: `hidden_size` wide with 16-wide heads and an MLP twice as wide,
    `num_layers` deep. A config only: no weights, no random numbers drawn."""
    return config_cls(
        vocab_size=len(tokenizer.get_vocab()),
        d_model=hidden_size,
        d_ff=2 * hidden_size,
        d_kv=16,
        num_layers=num_layers,
        num_heads=num_heads,
        decoder_start_token_id=0,
    )


def tiny_clip_t5_text(cfg, t5_max_length: int, t5_heads: int, **clip_options):
    """The text side of a tiny CLIP + T5 family (SD3, FLUX.1), built in code, no weights:
    (CLIP tokenizer, T5 tokenizer, `CLIPTextConfig`, `T5Config`), from `cfg`'s `clip_max_length`,
    `words`, `clip_hidden_size`, `t5_hidden_size` and `text_layers` (`tiny_clip_t5_tokenizers`,
    `tiny_clip_config` with `clip_options`, `tiny_t5_config` with `t5_heads` heads); the T5
    tokenizer's budget is `t5_max_length`. No random numbers drawn: the family builds the models
    from the configs in its own order."""
    from transformers import T5Config

    clip_tok, t5_tok = tiny_clip_t5_tokenizers(
        cfg.clip_max_length, t5_max_length=t5_max_length, words=cfg.words
    )
    clip_cfg = tiny_clip_config(clip_tok, cfg, **clip_options)
    t5_cfg = tiny_t5_config(T5Config, t5_tok, cfg.t5_hidden_size, cfg.text_layers, num_heads=t5_heads)
    return clip_tok, t5_tok, clip_cfg, t5_cfg


QWEN_SPLIT = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
"""Qwen2's pre-tokenization pattern (its `tokenizer.json`): a word with at most one non-letter
before it, every digit alone, punctuation runs, newlines, and whitespace runs that leave their
last space to the next piece."""


def tiny_qwen_tokenizer(words: list[str], template: str, qwen_split: bool = False):
    """A Qwen2-style byte-level BPE tokenizer built in code (no files): GPT-2's pre-tokenization,
    or with `qwen_split` Qwen2's own (`QWEN_SPLIT`: digits alone, so a template with numbers
    tokenizes into as many pieces as with the real tokenizer; HunyuanVideo 1.5 crops a fixed
    108-token prefix whose numbered list needs it),
    `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` and Qwen2.5-VL's vision tokens as special
    tokens, and merges under which every word of the prompt `template` (the words of the
    pipeline's prompt template) and of `words` is one token: the tiny tokenizer of the families
    whose prompt encoder is a Qwen model (Qwen-Image, its edit model, Z-Image, FLUX.2,
    HunyuanVideo 1.5)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from unirl.models.causal_lm.tiny import VISION_TOKENS, fast_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not qwen_split)
    if qwen_split:
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Split(Regex(QWEN_SPLIT), behavior="isolated"), tok.pre_tokenizer]
        )
    tok.decoder = decoders.ByteLevel()
    corpus = [template, " ".join(words), " " + " ".join(words)]  # each word alone and after a space
    trainer = trainers.BpeTrainer(
        vocab_size=100_000, min_frequency=1, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    tok.train_from_iterator(corpus, trainer)  # merges until every word of the corpus is one token
    return fast_tokenizer(tok, VISION_TOKENS)


def tiny_autoencoder_kl(downsample: int, latent_channels: int, **options):
    """A tiny random diffusers `AutoencoderKL` (SD3's and FLUX's VAE class) that downsamples
    `downsample`x (a power of 2 >= 2: log2 + 1 blocks, 16 then 32 channels wide) into
    `latent_channels` channels; `options` are the family's (scaling and shift factors, quant
    convs). Built here, so its weights draw from the global generator at the call."""
    from diffusers import AutoencoderKL

    levels = downsample.bit_length()  # 2 -> 2 blocks (one downsample), 8 -> 4 blocks
    return AutoencoderKL(
        down_block_types=("DownEncoderBlock2D",) * levels,
        up_block_types=("UpDecoderBlock2D",) * levels,
        block_out_channels=(16,) + (32,) * (levels - 1),
        latent_channels=latent_channels,
        norm_num_groups=8,
        **options,
    )


def tiny_causal_vae(vae_cls: type, base_dim: int, channels: int, levels: int, **options):
    """A tiny random Wan-style causal 3D VAE (`vae_cls`: `AutoencoderKLWan`, or Qwen-Image's
    `AutoencoderKLQwenImage`) with `levels` spatial downsamples into `channels` latent channels,
    `base_dim` x Wan's width multipliers (1, 2, 4, 4 at 8x), normalized per channel by a fixed
    latents mean / std (linspace(-0.5, 0.5) and linspace(0.8, 2.0)); `options` are the family's
    (`num_res_blocks`, `temperal_downsample`, scale factors). Built here, so its weights draw from
    the global generator at the call."""
    import torch

    return vae_cls(
        base_dim=base_dim,
        z_dim=channels,
        dim_mult=[1, 2, 4, 4, 4, 4][: levels + 1],  # Wan's / Qwen-Image's (1, 2, 4, 4) at 8x
        latents_mean=torch.linspace(-0.5, 0.5, channels, device="cpu").tolist(),
        latents_std=torch.linspace(0.8, 2.0, channels, device="cpu").tolist(),
        **options,
    )


def write_diffusers_weights(
    pipeline_cls: type,
    path: str,
    kind: str,
    state: dict[str, torch.Tensor],
    module: torch.nn.Module,
    adapter: torch.nn.Module | None = None,
) -> None:
    """The train backend's exporter for a diffusers family: a LoRA as
    `pytorch_lora_weights.safetensors` with its adapter config (alpha) in the file's metadata,
    what `pipeline_cls.load_lora_weights` reads (without the metadata diffusers loads
    lora_alpha = rank and scales the update by 1 instead of alpha / rank); a full state as a
    `transformer/` directory, written by a fresh unsharded copy of the module's own class.
    `adapter` is the module whose `peft_config` holds the adapter (`module` by default; the
    container of a part of several, as Wan 2.2's experts)."""
    if kind == "lora":
        pipeline_cls.save_lora_weights(
            path,
            transformer_lora_layers=state,
            transformer_lora_adapter_metadata=(adapter or module).peft_config["default"].to_dict(),
        )
        return
    cls = next(c for c in type(module).__mro__ if not c.__name__.startswith("FSDP"))
    fresh = cls.from_config(module.config)
    fresh.load_state_dict(state)
    fresh.save_pretrained(os.path.join(path, "transformer"))
