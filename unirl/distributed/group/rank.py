"""Where one worker sits in its group: global, data-parallel and model-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RankInfo:
    """Position of one worker in a worker group.

    Contract: ``0 <= rank < world_size`` and every ``*_rank`` is within its
    ``*_size``. ``local_rank`` is the worker's index among the group's workers
    on the same node and ``node_rank`` the index of that node among the nodes
    the group spans (both in order of first appearance). Model-parallel sizes
    (TP/PP/SP/EP) default to 1 with rank 0; until a group is built with a
    mesh, ``dp_rank == rank`` and ``dp_size == world_size``.

    ``master_addr``/``master_port`` are the torch.distributed rendezvous
    endpoint chosen by the driver for the whole group (the worker exports them
    as ``MASTER_ADDR``/``MASTER_PORT``); ``master_port == 0`` means unset.
    """

    rank: int
    world_size: int
    dp_rank: int
    dp_size: int
    local_rank: int = 0
    node_rank: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    sp_rank: int = 0
    sp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 0

    def __post_init__(self) -> None:
        pairs = {
            "rank": (self.rank, self.world_size),
            "dp_rank": (self.dp_rank, self.dp_size),
            "tp_rank": (self.tp_rank, self.tp_size),
            "pp_rank": (self.pp_rank, self.pp_size),
            "sp_rank": (self.sp_rank, self.sp_size),
            "ep_rank": (self.ep_rank, self.ep_size),
        }
        for name, (r, size) in pairs.items():
            if size < 1 or not 0 <= r < size:
                raise ValueError(f"RankInfo.{name}={r} is outside [0, {size})")
        if self.local_rank < 0 or self.node_rank < 0:
            raise ValueError("RankInfo.local_rank and node_rank must be >= 0")

    @property
    def is_rank_zero(self) -> bool:
        """True on the group's global rank 0."""
        return self.rank == 0
