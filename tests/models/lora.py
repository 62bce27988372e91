"""A LoRA-wrapped train backend with a trained-looking adapter, shared by the families' export
tests."""

from __future__ import annotations

from collections.abc import Callable

import torch

from unirl.train.backend import LoRAConfig, OptimConfig, TrainBackend


def trained_lora_backend(
    module: torch.nn.Module, targets: list[str], writer: Callable | None = None, rank: int = 2, alpha: int = 8
) -> TrainBackend:
    """A `TrainBackend` with a LoRA (`rank`, `alpha`, on `targets`) on `module`, exporting through
    `writer`, whose every `lora_B` is drawn N(0, 0.1^2) from seed 0: peft starts them at zero, an
    adapter that changes nothing."""
    backend = TrainBackend(
        module, LoRAConfig(rank=rank, alpha=alpha, target_modules=targets), OptimConfig(), 1, writer=writer
    )
    with torch.no_grad():
        gen = torch.Generator().manual_seed(0)
        for name, p in backend.module.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return backend
