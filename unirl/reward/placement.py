"""Where a model-based scorer's weights rest between calls (the `offload` option)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch


@contextmanager
def on_device_while_scoring(device: torch.device, offload: bool, *modules: torch.nn.Module) -> Iterator[None]:
    """With `offload`, `modules` move to `device` for the block and back to host memory after it
    (CUDA's cache emptied), so a scorer colocated with the rollout gives its accelerator memory back
    between calls; without, they stay where they are."""
    if offload:
        for m in modules:
            m.to(device)
    try:
        yield
    finally:
        if offload:
            for m in modules:
                m.to("cpu")
            if device.type == "cuda":
                torch.cuda.empty_cache()
