"""Differentiable collectives with a different number of rows on each rank."""

import math

import torch
import torch.distributed as dist

from megalite.parallel import comm


def _all_to_all(x, output_splits, input_splits, group):
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


def _count(traffic, x, splits, group):
    if traffic is not None:
        remote_rows = sum(splits) - splits[comm.group_rank(group)]
        traffic[0] += remote_rows * math.prod(x.shape[1:]) * x.element_size()


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group, traffic):
        ctx.splits, ctx.group, ctx.traffic = (output_splits, input_splits), group, traffic
        _count(traffic, x, input_splits, group)
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        _count(ctx.traffic, grad, output_splits, ctx.group)
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group,
               traffic: list | None = None) -> torch.Tensor:
    """Rows input_splits[r] of `x` go to rank r; rows output_splits[r] arrive from rank r, in
    rank order. The backward sends the gradients back the same way. `traffic` ([bytes]) counts
    the bytes this rank sends to other ranks, forward and backward."""
    if comm.group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group, traffic)


def _gather_rows(x, sizes, group):
    widest = max(sizes)
    padded = x.new_zeros((widest, *x.shape[1:]))
    padded[:x.shape[0]] = x
    out = comm.all_gather_dim0(padded, group)
    return torch.cat([out[r * widest:r * widest + n] for r, n in enumerate(sizes)])


def _own_rows(x, sizes, group):
    start = sum(sizes[:comm.group_rank(group)])
    return x[start:start + sizes[comm.group_rank(group)]].contiguous()


def _reduce_scatter_rows(x, sizes, group):
    return _own_rows(comm.all_reduce(x.clone(memory_format=torch.contiguous_format), group), sizes, group)


def row_counts(n: int, group, device=None) -> list[int]:
    """Every rank's `n`, in rank order."""
    if comm.group_size(group) == 1:
        return [n]
    counts = torch.tensor([n], dtype=torch.long, device=device)
    return comm.all_gather_dim0(counts, group).tolist()


def gather_rows(x: torch.Tensor, sizes: list[int], group, grad_is_partial: bool = True) -> torch.Tensor:
    """Concatenate every rank's rows (sizes[r] rows on rank r); the backward sums the
    gradients over the group and keeps this rank's rows, or with grad_is_partial=False (every
    rank computes the same gradient) only keeps them."""
    if comm.group_size(group) == 1:
        return x
    return comm.paired(x, _gather_rows, _reduce_scatter_rows if grad_is_partial else _own_rows, list(sizes), group)


def scatter_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """This rank's rows of `x` (the same on every rank): sizes[r] rows for rank r, in rank
    order; the backward gathers every rank's gradient rows."""
    if comm.group_size(group) == 1:
        return x
    return comm.paired(x, _own_rows, _gather_rows, list(sizes), group)


def reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Sum `x` (sum(sizes) rows) over the group and keep this rank's sizes[rank] rows."""
    if comm.group_size(group) == 1:
        return x
    return comm.paired(x, _reduce_scatter_rows, _gather_rows, list(sizes), group)
