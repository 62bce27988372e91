"""What flow-matching families share to load, build and export: the scheduler options the pinned
sigma schedules reproduce, the tiny CLIP / T5 tokenizers built in code (no files, no hub), the
VAE decode with scaling and shift (`vae_pixels`), and the diffusers weight export
(`write_diffusers_weights`)."""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

from unirl.sde.schedules import NUM_TRAIN_TIMESTEPS

if TYPE_CHECKING:
    import torch


def vae_pixels(vae, latents):
    """[B, 3, H, W] fp32 RGB in about [-1, 1] (unclamped), differentiable: the VAE decode of
    latents / scaling_factor + shift_factor, or the latents themselves in pixel space (vae None)."""
    if vae is None:
        return latents.float()
    scaled = latents.to(vae.dtype) / vae.config.scaling_factor + (vae.config.shift_factor or 0.0)
    return vae.decode(scaled, return_dict=False)[0].float()


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
        return [
            f"model.pretrained_path: {path!r} is not a directory; point it (or PRETRAINED_MODEL) at "
            f"a local diffusers {family} directory, or set it to null to use model.tiny"
        ]
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


def write_diffusers_weights(
    pipeline_cls: type, path: str, kind: str, state: dict[str, torch.Tensor], module: torch.nn.Module
) -> None:
    """The train backend's exporter for a diffusers family: a LoRA as
    `pytorch_lora_weights.safetensors` with its adapter config (alpha) in the file's metadata,
    what `pipeline_cls.load_lora_weights` reads (without the metadata diffusers loads
    lora_alpha = rank and scales the update by 1 instead of alpha / rank); a full state as a
    `transformer/` directory, written by a fresh unsharded copy of the module's own class."""
    if kind == "lora":
        pipeline_cls.save_lora_weights(
            path,
            transformer_lora_layers=state,
            transformer_lora_adapter_metadata=module.peft_config["default"].to_dict(),
        )
        return
    cls = next(c for c in type(module).__mro__ if not c.__name__.startswith("FSDP"))
    fresh = cls.from_config(module.config)
    fresh.load_state_dict(state)
    fresh.save_pretrained(os.path.join(path, "transformer"))
