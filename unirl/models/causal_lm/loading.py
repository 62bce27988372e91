"""What the text families share to load and train: the body of their model configs
(`TransformersFamilyConfig`), the supervised pair encoding, the module tree on the meta device,
the checkpoint load, the VLM directory check."""

from __future__ import annotations

import importlib
import json
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from unirl.models.source import DTYPES, ModelSource, check_source, read_checkpoint_meta

if TYPE_CHECKING:
    from unirl.models.causal_lm.family import TextBundle

IGNORE_INDEX = -100  # a label position no loss reads (prompt, padding)


class TransformersFamilyConfig(ModelSource):
    """The shared body of a transformers family's model config (Qwen, Qwen-VL, Janus), a dataclass
    that adds `tiny` (default None: exactly one of `pretrained_path` / `tiny`) to `ModelSource`.
    From class attributes it answers the source check, `build`, `load_checkpoint` and
    `trainable_on_meta`:

    - `MODELING`, `BUNDLE`: the modeling module and its bundle class (`from_pretrained(path,
      dtype=)`, `tiny(tiny, dtype=)`, `auto_model`), named, not imported, so that building a
      recipe node reads no weights and pulls in no bundle;
    - `TINY`: the tiny config class; `WHAT`: the directory in the source error ("causal-LM");
    - `MODEL_CLASS`, `CONFIG_CLASS`: transformers' names of what builds the model from a
      directory's config (an Auto class's `from_config`, or a model class itself) and what reads
      that config (None: `AutoConfig`), for the module tree on the meta device.
    The family answers `directory_problems` itself."""

    MODELING: ClassVar[str]
    BUNDLE: ClassVar[str]
    TINY: ClassVar[type]
    WHAT: ClassVar[str]
    MODEL_CLASS: ClassVar[str]
    CONFIG_CLASS: ClassVar[str | None] = None

    def __post_init__(self) -> None:
        check_source(self, self.TINY, self.WHAT, exclusive=True)

    def bundle_class(self) -> Any:
        """The family's bundle class (`MODELING`.`BUNDLE`)."""
        return getattr(importlib.import_module(self.MODELING), self.BUNDLE)

    def build(self) -> Any:
        """The bundle: from `pretrained_path`, else from the tiny config, in `dtype`."""
        bundle = self.bundle_class()
        if self.pretrained_path is not None:
            return bundle.from_pretrained(self.pretrained_path, dtype=DTYPES[self.dtype])
        return bundle.tiny(self.tiny, dtype=DTYPES[self.dtype])

    def load_checkpoint(self, path: str) -> Any:
        """The bundle of a UniRL checkpoint of this family's run, fp32 (a LoRA merged, or the full
        weights: `load_checkpoint`)."""
        return load_checkpoint(path, self.bundle_class())

    def trainable_on_meta(self) -> torch.nn.Module:
        """The model's module tree on the meta device (no weights read): for validators that
        check names (FSDP blocks, LoRA targets) before any work starts."""
        import transformers

        model_class = getattr(transformers, self.MODEL_CLASS)
        config_class = getattr(transformers, self.CONFIG_CLASS) if self.CONFIG_CLASS else None
        return model_on_meta(
            self.pretrained_path,
            getattr(model_class, "from_config", model_class),  # an Auto class, or the model class
            lambda: self.bundle_class().tiny(self.tiny).model,
            config_cls=config_class,
        )


def model_on_meta(
    pretrained_path: str | None,
    from_config: Callable[[Any], torch.nn.Module],
    tiny_model: Callable[[], torch.nn.Module],
    config_cls: Any = None,
) -> torch.nn.Module:
    """A text or unified family's `trainable_on_meta`: the model's module tree on the meta device,
    no weights read (validators check FSDP block and LoRA target names against it). With
    `pretrained_path`, `from_config(config)` of its config (read by `config_cls.from_pretrained`,
    transformers' `AutoConfig` when None, local files only) under the meta device; else
    `tiny_model()` (the tiny config's model) under the meta device."""
    if pretrained_path is not None:
        if config_cls is None:
            from transformers import AutoConfig

            config_cls = AutoConfig
        config = config_cls.from_pretrained(pretrained_path, local_files_only=True)
        with torch.device("meta"):
            return from_config(config)
    with torch.device("meta"):
        return tiny_model()


def encode_pairs(
    tokenizer: Any, pairs: list[tuple[str, str]], max_positions: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tokenize (prompt, completion) pairs into one right-padded batch.

    Row i is prompt_i + completion_i + [EOS] (prompt and completion each through
    `tokenizer(text, add_special_tokens=False)`, as rollouts tokenize prompts).

    Returns (input_ids [B, L] long, padded with the pad id; attention_mask [B, L] long;
    labels [B, L] long: the token at completion and EOS positions, IGNORE_INDEX at prompt
    and padding positions). A row longer than `max_positions` is an error naming it.
    """
    prompts = tokenizer([p for p, _ in pairs], add_special_tokens=False)["input_ids"]
    completions = tokenizer([c for _, c in pairs], add_special_tokens=False)["input_ids"]
    rows, labels = [], []
    for (prompt, completion), p, c in zip(pairs, prompts, completions, strict=True):
        if not p:
            raise ValueError(f"the prompt of pair {(prompt, completion)!r} is empty (0 tokens)")
        seq = p + c + [tokenizer.eos_token_id]
        if len(seq) > max_positions:
            raise ValueError(
                f"pair {(prompt, completion)!r} is {len(seq)} tokens with EOS, more than the model's "
                f"max_position_embeddings ({max_positions}); shorten the data or enlarge the model"
            )
        rows.append(seq)
        labels.append([IGNORE_INDEX] * len(p) + c + [tokenizer.eos_token_id])
    width = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    target = torch.full((len(rows), width), IGNORE_INDEX, dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, labels, strict=True)):
        input_ids[i, : len(r)] = torch.tensor(r)
        mask[i, : len(r)] = 1
        target[i, : len(r)] = torch.tensor(lab)
    return input_ids, mask, target


def is_vlm_directory(path: str) -> bool | None:
    """Whether `path/config.json` describes a vision-language model (it has a `vision_config`);
    None when there is no readable config.json."""
    try:
        with open(os.path.join(path, "config.json")) as f:
            return "vision_config" in json.load(f)
    except (OSError, ValueError):
        return None


def load_checkpoint(
    path: str, bundle_cls: type[TextBundle], dtype: torch.dtype = torch.float32
) -> TextBundle:
    """Load a bundle with the trained weights of a UniRL checkpoint directory.

    `bundle_cls` is the family's bundle (its `from_pretrained` and `auto_model`). Reads
    `unirl_checkpoint.json` (written by the train backend), loads its
    `base_model` directory, then applies the weights: a LoRA adapter directory
    merged into the base through peft (`PeftModel.from_pretrained(...).merge_and_unload()`),
    or the full model directory itself.
    """
    meta = read_checkpoint_meta(path)
    base = bundle_cls.from_pretrained(meta["base_model"], dtype=dtype)
    if meta["kind"] == "lora":
        from peft import PeftModel

        base.model = PeftModel.from_pretrained(base.model, path, local_files_only=True).merge_and_unload()
        return base
    base.model = bundle_cls.auto_model.from_pretrained(path, dtype=dtype, local_files_only=True)
    return base
