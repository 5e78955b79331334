"""Differentiable collectives with a different number of rows on each rank."""

import torch
import torch.distributed as dist

from megalite.parallel import comm


def _all_to_all(x, output_splits, input_splits, group):
    out = x.new_empty((sum(output_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
    return out


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        return _all_to_all(x, output_splits, input_splits, group)

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _all_to_all(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group) -> torch.Tensor:
    """Rows input_splits[r] of `x` go to rank r; rows output_splits[r] arrive from rank r, in
    rank order. The backward sends the gradients back the same way."""
    if comm.group_size(group) == 1:
        return x
    return _AllToAll.apply(x, list(output_splits), list(input_splits), group)


def _gather_rows(x, sizes, group):
    widest = max(sizes)
    padded = x.new_zeros((widest, *x.shape[1:]))
    padded[:x.shape[0]] = x
    out = comm.all_gather_dim0(padded, group)
    return torch.cat([out[r * widest:r * widest + n] for r, n in enumerate(sizes)])


def _reduce_scatter_rows(x, sizes, group):
    summed = comm.all_reduce(x.clone(memory_format=torch.contiguous_format), group)
    start = sum(sizes[:comm.group_rank(group)])
    return summed[start:start + sizes[comm.group_rank(group)]].contiguous()


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _gather_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter_rows(grad, ctx.sizes, ctx.group), None, None


class _ReduceScatterRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, sizes, group):
        ctx.sizes, ctx.group = sizes, group
        return _reduce_scatter_rows(x, sizes, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_rows(grad, ctx.sizes, ctx.group), None, None


def row_counts(n: int, group, device=None) -> list[int]:
    """Every rank's `n`, in rank order."""
    if comm.group_size(group) == 1:
        return [n]
    counts = torch.tensor([n], dtype=torch.long, device=device)
    return comm.all_gather_dim0(counts, group).tolist()


def gather_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Concatenate every rank's rows (sizes[r] rows on rank r); the backward sums the
    gradients over the group and keeps this rank's rows."""
    if comm.group_size(group) == 1:
        return x
    return _GatherRows.apply(x, list(sizes), group)


def reduce_scatter_rows(x: torch.Tensor, sizes: list[int], group) -> torch.Tensor:
    """Sum `x` (sum(sizes) rows) over the group and keep this rank's sizes[rank] rows."""
    if comm.group_size(group) == 1:
        return x
    return _ReduceScatterRows.apply(x, list(sizes), group)
