"""Rules of what a recipe refers to by name or path: the thing named must exist.

A path the run will read (a model directory, ...) must be there before Ray starts, and a name
that selects something (a LoRA target module, an FSDP block class, ...) must select at least
one thing; otherwise the run would fail late inside a worker, or silently do nothing. Each
problem names the full key, the value, and what does exist.
"""

from __future__ import annotations

import os
from typing import Any


def check_model_path(model: Any, problems: list[str]) -> None:
    """`model.pretrained_path`, when set, is a directory."""
    if model is not None and model.pretrained_path and not os.path.isdir(model.pretrained_path):
        kind = {"text": "Hugging Face causal-LM (Qwen3 / Qwen2)"}.get(
            getattr(model, "modality", None), "diffusers SD3 / SD3.5"
        )
        problems.append(
            f"model.pretrained_path: {model.pretrained_path!r} is not a directory; point it (or PRETRAINED_MODEL) at "
            f"a local {kind} directory, or set it to null to use model.tiny"
        )
