"""How a test's ranks start and form one gloo process group.

They start forked from one server process per test process (`rank_context`, `spawn_ranks`):
that server imported torch, diffusers, transformers and peft once, where a spawned rank spends
about 8 s of a 2-core machine importing them afresh; it has run no torch op, so no thread pool is
forked. They meet through a file in the test's own directory, not a TCP port: a port picked free
by the parent can be taken by any other process before rank 0 binds it (CI saw `EADDRINUSE`); a
file path cannot."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

# what every rank imports anyway, imported once in the fork server
PRELOAD = [
    "torch",
    "torch.distributed.fsdp",
    "torch.distributed.checkpoint",
    "diffusers",
    "transformers",
    "peft",
]


def rank_context() -> Any:
    """The multiprocessing context a test's ranks start in: processes forked from the preloaded
    fork server (the preload takes effect when the server starts, on first use)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def spawn_ranks(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` ranks started from `rank_context()`; returns when all have
    exited, raising if one failed (as `torch.multiprocessing.spawn`)."""
    rank_context()
    mp.start_processes(fn, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def join_gloo(rank: int, world: int, directory: str) -> None:
    """Rank `rank` of `world` joins the default gloo group rendezvousing in `directory` (a fresh
    directory per group: the store file must not exist from an earlier group)."""
    import torch.distributed as dist

    path = os.path.join(directory, "gloo_rendezvous")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
