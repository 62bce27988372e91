"""Where every model config's weights come from and in which dtype: one rule for all families.

A model config is a `ModelSource` dataclass: `pretrained_path` (a local directory in its
library's layout) and `dtype` (`DType`, the frozen components' parameter dtype, or the whole
model's for a causal LM) here, and `tiny` (a tiny-model config built from random weights; a dict
from a recipe becomes the family's tiny config class), which each family declares with its own
tiny config type and default. `check_source` runs in every family's `__post_init__`: the typed
ranges (`unirl.types.constraints.check_fields`, keys under `model.`), then which of the two
sources is set. `missing_directory_problems` is every family's first answer to the validator about
`pretrained_path`, `read_checkpoint_meta` the first step of every family's `load_checkpoint`.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any, Literal

import torch

from unirl.types.constraints import check_fields

DType = Literal["float32", "bfloat16", "float16"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelSource:
    """The fields every model config (a recipe's `model:` node) starts with; a family's config
    subclasses it (through its kind's shared body: `FlowFamilyConfig`, `TransformersFamilyConfig`)
    and adds `tiny` and its own options.

    Attributes:
        pretrained_path: a local directory of the family's weights, in its library's layout (a
            diffusers pipeline, a transformers model with its tokenizer); null: build `tiny`.
        dtype: parameter dtype ("float32", "bfloat16", "float16") of the frozen components (a
            diffusion family's text encoders and VAE: the trainable denoiser stays fp32 master
            weights unless the backend casts it), or of the whole model (a text or unified family).
    """

    pretrained_path: str | None = None
    dtype: DType = "float32"


def check_source(config: Any, tiny_class: type, what: str, exclusive: bool = False) -> None:
    """Make `config.tiny` a `tiny_class` when given as a dict, check `config`'s typed fields, and
    require a source: `pretrained_path` (a local `what` directory) or `tiny`; with `exclusive`,
    exactly one of them (a family whose tiny default is None). Raises ValueError naming the keys."""
    if isinstance(config.tiny, dict):
        config.tiny = tiny_class(**config.tiny)
    check_fields(config, "model.")
    if exclusive and (config.pretrained_path is None) == (config.tiny is None):
        raise ValueError(
            f"model: set exactly one of model.pretrained_path (a local {what} directory) and model.tiny, "
            f"got pretrained_path={config.pretrained_path!r} and tiny={config.tiny}"
        )
    if config.pretrained_path is None and config.tiny is None:
        raise ValueError(f"model: set model.pretrained_path to a local {what} directory or give model.tiny")


def missing_directory_problems(path: str | None, what: str) -> list[str]:
    """The validator's first question about `model.pretrained_path`, the same for every family:
    one problem naming the key when it is set but not a directory (pointing it at "a local `what`
    directory", e.g. "diffusers FLUX.1" or "Hugging Face VLM (Qwen2.5-VL / Qwen3-VL)", or at
    model.tiny), else [] (unset, or a directory: the family checks what it holds)."""
    if path and not os.path.isdir(path):
        return [
            f"model.pretrained_path: {path!r} is not a directory; point it (or PRETRAINED_MODEL) at "
            f"a local {what} directory, or set it to null to use model.tiny"
        ]
    return []


def read_checkpoint_meta(path: str) -> dict[str, Any]:
    """The `unirl_checkpoint.json` of a UniRL checkpoint directory (written by the train backend:
    `base_model`, the directory the weights were trained from, and `kind`, "lora" or "full"), the
    first step of every family's `load_checkpoint`.

    Raises:
        FileNotFoundError: `path` holds no `unirl_checkpoint.json` (not a UniRL checkpoint).
    """
    meta_path = os.path.join(path, "unirl_checkpoint.json")
    if not os.path.isfile(meta_path):
        raise FileNotFoundError(f"{path!r} is not a UniRL checkpoint: {meta_path} is missing")
    with open(meta_path) as f:
        return json.load(f)
