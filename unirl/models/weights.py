"""Weights swapped in place for the body of a `with`: the reference policy, an EMA snapshot, a
teacher's LoRA. Shared by the train backend, the EMA and the algorithms that evaluate other
weights inside their loss; FSDP2-aware (`reshard_all`). And a whole bundle written with its
weights in another dtype (`export_bundle`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed.fsdp import FSDPModule


def reshard_all(module: torch.nn.Module | None) -> None:
    """Reshard every FSDP module in `module` (no-op for None or an unsharded module).

    FSDP2 keeps the root's all-gathered weights after a forward without backward
    (a no_grad rollout) and the next forward reuses them, so writes to the
    sharded parameters go unseen until every FSDP module is resharded.
    """
    if module is None:
        return
    for sub in module.modules():
        if isinstance(sub, FSDPModule):
            sub.reshard()


@contextlib.contextmanager
def swapped_weights(
    params: list[torch.Tensor], values: list[torch.Tensor], module: torch.nn.Module | None = None
) -> Iterator[None]:
    """Run the body with `values` copied into `params` (cast to their dtype); the
    live values come back bit-exactly on exit, also when the body raises.
    `module`: the FSDP root to reshard on entry and exit (see `reshard_all`)."""
    with torch.no_grad():
        reshard_all(module)
        live = [p.detach().clone() for p in params]
        for p, v in zip(params, values, strict=True):
            p.copy_(v)
    try:
        yield
    finally:
        with torch.no_grad():
            reshard_all(module)
            for p, v in zip(params, live, strict=True):
                p.copy_(v)


def export_bundle(bundle: Any, path: str, dtype: torch.dtype = torch.float16) -> None:
    """Write the whole bundle (`save_pretrained`: its library's layout, what the family's
    `pretrained_path` loads) with its weights in `dtype`; the bundle goes back to fp32 after. A
    LoRA a diffusers bundle's checkpoint loaded onto its modules is fused into their weights
    first (a text bundle's checkpoint load merges it already), so the directory holds the trained
    model alone."""
    pipeline = getattr(bundle, "pipeline", None)
    for module in getattr(pipeline, "components", {}).values():
        if getattr(module, "peft_config", None) and callable(getattr(module, "fuse_lora", None)):
            module.fuse_lora()
            module.unload_lora()
    bundle.to(dtype)
    try:
        bundle.save_pretrained(path)
    finally:
        bundle.to(torch.float32)
