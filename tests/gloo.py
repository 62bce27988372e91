"""How a test's spawned ranks form one gloo process group: they meet through a file in the
test's own directory, not a TCP port. A port picked free by the parent can be taken by any other
process before rank 0 binds it (CI saw `EADDRINUSE`); a file path cannot."""

from __future__ import annotations

import os


def join_gloo(rank: int, world: int, directory: str) -> None:
    """Rank `rank` of `world` joins the default gloo group rendezvousing in `directory` (a fresh
    directory per group: the store file must not exist from an earlier group)."""
    import torch.distributed as dist

    path = os.path.join(directory, "gloo_rendezvous")
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
