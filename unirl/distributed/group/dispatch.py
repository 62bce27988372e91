"""How a worker-group call fans out to ranks and how the results come back.

Tag a worker method with ``@dispatch(Dispatch.X)``; untagged methods are
`Dispatch.BROADCAST`. Each mode is a `DispatchSpec` in `DISPATCH_SPECS`:

- ``scatter(world_size, args, kwargs)`` -> per rank either ``(args, kwargs)``
  or None (that rank is not called);
- ``gather(results)`` -> what the driver gets, from the results of the called
  ranks in rank order.

Collective rule: a method that runs collectives (torch.distributed, NCCL,
gloo) must be called on every rank at once, i.e. BROADCAST, DP_SCATTER or
ALL_RANKS_RETURN_ZERO, never RANK_ZERO (rank 0 would wait for peers that are
never called).

To add a mode, add a member to `Dispatch` and a `DispatchSpec` for it to
`DISPATCH_SPECS`.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from unirl.types import batch as batch_ops

F = TypeVar("F", bound=Callable[..., Any])

DISPATCH_ATTR = "__unirl_dispatch__"

RankCall = tuple[tuple[Any, ...], dict[str, Any]]


class Dispatch(enum.Enum):
    """Dispatch modes of worker-group methods.

    BROADCAST: same args to every rank; returns the list of results in rank order.
    DP_SCATTER: every arg that can be split is split into ``world_size`` parts
        (rank i gets part i); the other args are broadcast. Results are gathered
        in rank order: ``type(r0).concat(results)`` when the result type has a
        static/class method ``concat``; `unirl.types.batch.concat` for batch
        dataclasses (``PER_SAMPLE``); ``torch.cat`` along dim 0 for tensors;
        None when every rank returned None; otherwise (e.g. per-rank dicts of
        float metrics) the list of per-rank results as is.
    RANK_ZERO: only rank 0 is called and its result returned. The other ranks
        are NOT called, so it must not be used for methods that run collectives.
    ALL_RANKS_RETURN_ZERO: same args to every rank, called on all ranks at once
        (safe for collectives); returns rank 0's result.
    """

    BROADCAST = "broadcast"
    DP_SCATTER = "dp_scatter"
    RANK_ZERO = "rank_zero"
    ALL_RANKS_RETURN_ZERO = "all_ranks_return_zero"


def dispatch(mode: Dispatch) -> Callable[[F], F]:
    """Decorator tagging a worker method with its dispatch `mode` (the method itself is unchanged)."""
    if not isinstance(mode, Dispatch):
        raise TypeError(f"dispatch() takes a Dispatch member, got {mode!r}")

    def tag(fn: F) -> F:
        setattr(fn, DISPATCH_ATTR, mode)
        return fn

    return tag


def dispatch_mode(fn: Callable[..., Any]) -> Dispatch:
    """The mode `fn` was tagged with, or BROADCAST when untagged."""
    return getattr(fn, DISPATCH_ATTR, Dispatch.BROADCAST)


@dataclass(frozen=True)
class DispatchSpec:
    """Scatter and gather functions of one dispatch mode (see module docstring)."""

    scatter: Callable[[int, tuple[Any, ...], dict[str, Any]], list[RankCall | None]]
    gather: Callable[[list[Any]], Any]


# ---------------------------------------------------------------- scatter / gather helpers


def _is_splittable(obj: Any) -> bool:
    if isinstance(obj, (str, bytes, bytearray)):
        return False
    return (
        isinstance(obj, torch.Tensor) or hasattr(obj, "PER_SAMPLE") or callable(getattr(obj, "split", None))
    )


def split_for_ranks(obj: Any, world_size: int, name: str = "argument") -> list[Any]:
    """Split `obj` into exactly `world_size` parts, in rank order.

    Tensors are chunked evenly along dim 0 (``Tensor.split`` takes a chunk
    size, not a count); batch dataclasses without their own ``split`` use
    `unirl.types.batch.split`; anything else calls ``obj.split(world_size)``.
    Raises ValueError unless that yields `world_size` parts.
    """
    if isinstance(obj, torch.Tensor):
        if obj.dim() == 0 or obj.shape[0] % world_size:
            raise ValueError(
                f"{name}: tensor of shape {tuple(obj.shape)} does not split evenly over {world_size} ranks"
            )
        parts = list(torch.chunk(obj, world_size, dim=0))
    elif callable(getattr(obj, "split", None)):
        parts = list(obj.split(world_size))
    else:
        parts = batch_ops.split(obj, world_size)
    if len(parts) != world_size:
        raise ValueError(f"{name}: {type(obj).__name__}.split({world_size}) returned {len(parts)} parts")
    return parts


def _has_type_level(obj: Any, attr: str) -> bool:
    for klass in type(obj).__mro__:
        if attr in vars(klass):
            return isinstance(vars(klass)[attr], (staticmethod, classmethod))
    return False


def gather_dp(results: list[Any]) -> Any:
    """Merge per-rank DP results in rank order (rules in `Dispatch.DP_SCATTER`)."""
    if all(r is None for r in results):
        return None
    first = results[0]
    if _has_type_level(first, "concat"):
        return type(first).concat(results)
    if isinstance(first, torch.Tensor):
        return torch.cat(results, dim=0)
    if hasattr(first, "PER_SAMPLE"):
        return batch_ops.concat(results)
    return results


def _scatter_broadcast(
    world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[RankCall | None]:
    return [(args, kwargs) for _ in range(world_size)]


def _scatter_dp(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[RankCall | None]:
    split_args = [
        split_for_ranks(a, world_size, f"positional argument {i}") if _is_splittable(a) else [a] * world_size
        for i, a in enumerate(args)
    ]
    split_kwargs = {
        k: split_for_ranks(v, world_size, f"argument {k!r}") if _is_splittable(v) else [v] * world_size
        for k, v in kwargs.items()
    }
    return [
        (tuple(parts[r] for parts in split_args), {k: parts[r] for k, parts in split_kwargs.items()})
        for r in range(world_size)
    ]


def _scatter_rank_zero(
    world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> list[RankCall | None]:
    return [(args, kwargs)] + [None] * (world_size - 1)


def in_groups(spec: DispatchSpec, group: int) -> DispatchSpec:
    """`spec` over groups of `group` consecutive ranks that act as one data-parallel rank (a
    sequence-parallel group: its ranks hold the same samples): scatter into world / group parts,
    part i to every rank of group i; gather the first rank's result of each group. `group` 1:
    `spec` itself."""
    if group == 1:
        return spec

    def scatter(world_size: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[RankCall | None]:
        if world_size % group:
            raise ValueError(f"{world_size} ranks do not form groups of {group}")
        parts = spec.scatter(world_size // group, args, kwargs)
        return [parts[r // group] for r in range(world_size)]

    return DispatchSpec(scatter, lambda results: spec.gather(results[::group]))


DISPATCH_SPECS: dict[Dispatch, DispatchSpec] = {
    Dispatch.BROADCAST: DispatchSpec(_scatter_broadcast, list),
    Dispatch.DP_SCATTER: DispatchSpec(_scatter_dp, gather_dp),
    Dispatch.RANK_ZERO: DispatchSpec(_scatter_rank_zero, lambda results: results[0]),
    Dispatch.ALL_RANKS_RETURN_ZERO: DispatchSpec(_scatter_broadcast, lambda results: results[0]),
}
