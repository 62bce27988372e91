"""Where every model config's weights come from and in which dtype: one rule for all families.

A model config has `pretrained_path` (a local directory in its library's layout), `tiny` (a
tiny-model config built from random weights; a dict from a recipe becomes the family's tiny
config class) and `dtype` (`DType`, the frozen components' parameter dtype, or the whole
model's for a causal LM). `check_source` runs in every family's `__post_init__`: the typed
ranges (`unirl.types.constraints.check_fields`, keys under `model.`), then which of the two
sources is set.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from unirl.types.constraints import check_fields

DType = Literal["float32", "bfloat16", "float16"]
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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
