"""Ulysses all-to-alls with their backward, for an attention processor a family writes itself
(diffusers' own processors get them inside `dispatch_attention_fn` from the context-parallel plan;
`unirl.train.sequence_parallel` applies that plan).

Tensors are [B, S, H, D]: batch, tokens, heads, head dim. `group` is one sequence-parallel group of
P ranks; rank i of the group holds the i-th of P equal token shards before attention and the i-th
of P equal head shards inside it. Every function is differentiable: its backward is the adjoint
collective, so gradients reach the rank and the shard that produced each value.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _all_to_all(x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
    """Split `x` into P chunks along `scatter_dim`, send chunk j to rank j, and join the P chunks
    received (in rank order) along `gather_dim`."""
    parts = dist.get_world_size(group)
    send = torch.stack(x.chunk(parts, dim=scatter_dim)).contiguous()
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=group)
    return torch.cat(received.unbind(0), dim=gather_dim)


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, group, scatter_dim: int, gather_dim: int) -> torch.Tensor:
        ctx.group, ctx.dims = group, (scatter_dim, gather_dim)
        return _all_to_all(x, group, scatter_dim, gather_dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        scatter_dim, gather_dim = ctx.dims
        return _all_to_all(grad, ctx.group, gather_dim, scatter_dim), None, None, None


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    """The group's tensors joined along `dim`, in rank order."""
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


class _Gather(torch.autograd.Function):
    """`_all_gather` along `dim`. Backward returns this rank's shard of the gradient: of the sum
    over the group's copies when `sum_copies` (each rank's copy fed its own loss terms), else of
    this rank's own gradient (every rank computes the same loss from the whole tensor, so the
    group's shards sum to the whole gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group, dim: int, sum_copies: bool) -> torch.Tensor:
        ctx.group, ctx.dim, ctx.sum_copies = group, dim, sum_copies
        return _all_gather(x, group, dim)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.sum_copies:
            grad = grad.contiguous().clone()
            dist.all_reduce(grad, group=ctx.group)
        own = grad.chunk(dist.get_world_size(ctx.group), dim=ctx.dim)[dist.get_rank(ctx.group)]
        return own.contiguous(), None, None, None


def seq_to_heads(x: torch.Tensor, group) -> torch.Tensor:
    """[B, S/P, H, D] (this rank's tokens, every head) -> [B, S, H/P, D] (every token, this rank's
    heads). H must divide by P."""
    return _AllToAll.apply(x, group, 2, 1)


def heads_to_seq(x: torch.Tensor, group) -> torch.Tensor:
    """The inverse of `seq_to_heads`: [B, S, H/P, D] -> [B, S/P, H, D]. S must divide by P."""
    return _AllToAll.apply(x, group, 1, 2)


def own_heads(x: torch.Tensor, group) -> torch.Tensor:
    """This rank's head shard [B, T, H/P, D] of a tensor every rank of the group holds whole
    [B, T, H, D] (tokens not split: a text sequence no degree divides)."""
    parts, rank = dist.get_world_size(group), dist.get_rank(group)
    return x.chunk(parts, dim=2)[rank]


def gather_heads(x: torch.Tensor, group) -> torch.Tensor:
    """The group's head shards joined [B, T, H/P, D] -> [B, T, H, D] on every rank (the whole
    tensor again after `own_heads`); backward sums the copies' gradients."""
    return _Gather.apply(x, group, 2, True)


def gather_seq(x: torch.Tensor, group) -> torch.Tensor:
    """The group's token shards joined [B, S/P, ...] -> [B, S, ...] on every rank, as diffusers'
    output gather: every rank then computes the same loss from it, so backward keeps only this
    rank's shard of the gradient (the sum over the group is the whole gradient; FSDP's average
    over ranks is undone by `TrainBackend.loss_multiplier`)."""
    return _Gather.apply(x, group, 1, False)
