"""Tensor- and sequence-parallel communication as autograd functions.

Named after the Megatron-LM paper (Shoeybi et al. 2019, fig. 3): `f` is the identity in
forward and an all-reduce in backward, `g` is the reverse. Sequence parallelism
(Korthikanti et al. 2022) replaces each all-reduce by an all-gather plus a reduce-scatter
along the sequence dimension (dim 0 of [seq, batch, hidden] activations).

Every function takes the process group explicitly; a group of None or of size 1 makes it the
identity, so single-process code pays nothing.
"""

import torch
import torch.distributed as dist


def group_size(group) -> int:
    return 1 if group is None else dist.get_world_size(group)


def group_rank(group) -> int:
    return 0 if group is None else dist.get_rank(group)


def all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` over the group in place; returns `x`."""
    if group_size(group) > 1:
        dist.all_reduce(x, group=group)
    return x


def _summed_copy(x: torch.Tensor, group) -> torch.Tensor:
    """The sum of `x` over the group in a new tensor. An autograd function must not change its
    forward inputs or incoming gradients in place: autograd hands one gradient tensor to every
    branch that consumed a value (y = f(x) + x), and other ops may have saved the input."""
    return all_reduce(x.clone(memory_format=torch.contiguous_format), group)


def all_gather_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """Concatenate every rank's `x` along dim 0."""
    n = group_size(group)
    if n == 1:
        return x
    out = x.new_empty((n * x.shape[0], *x.shape[1:]))
    dist.all_gather_single(out, x.contiguous(), group=group)
    return out


def reduce_scatter_into(out: torch.Tensor, x: torch.Tensor, group, op=dist.ReduceOp.SUM, async_op: bool = False):
    """Sum contiguous `x` over the group into `out`, this rank's 1/n slice of dim 0 (`out` may be
    that slice of `x` itself). On gloo in the list form: gloo's single-tensor reduce-scatter
    reduces into a scratch tensor the size of `x` and copies this rank's slice out of it. Under
    torch.compile the single-tensor form, the one Dynamo maps to a functional collective."""
    if not torch.compiler.is_compiling() and dist.get_backend(group) == "gloo":
        return dist.reduce_scatter(out, list(x.chunk(group_size(group))), op=op, group=group, async_op=async_op)
    return dist.reduce_scatter_single(out, x, op=op, group=group, async_op=async_op)


def reduce_scatter_dim0(x: torch.Tensor, group) -> torch.Tensor:
    """Sum `x` over the group and return this rank's 1/n slice of dim 0."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[0] % n:
        raise ValueError(f"reduce-scatter: dim 0 of size {x.shape[0]} is not divisible by group size {n}")
    out = x.new_empty((x.shape[0] // n, *x.shape[1:]))
    reduce_scatter_into(out, x.contiguous(), group)
    return out


def split_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """This rank's contiguous 1/n slice of `x` along `dim`."""
    n = group_size(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"cannot split dim {dim} of size {x.shape[dim]} over {n} ranks")
    return x.chunk(n, dim=dim)[group_rank(group)].contiguous()


def gather_dim(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """Concatenate every rank's `x` along `dim`."""
    if group_size(group) == 1:
        return x
    return all_gather_dim0(x.movedim(dim, 0), group).movedim(0, dim).contiguous()


class _Paired(torch.autograd.Function):
    """forward(x, *args) forward, backward(grad, *args) backward (see `paired`)."""

    @staticmethod
    def forward(ctx, x, forward, backward, *args):
        ctx.backward_fn, ctx.args = backward, args
        return forward(x, *args)

    @staticmethod
    def backward(ctx, grad):
        return (ctx.backward_fn(grad, *ctx.args), None, None) + (None,) * len(ctx.args)


def paired(x: torch.Tensor, forward, backward, *args) -> torch.Tensor:
    """forward(x, *args), differentiated as backward(grad, *args): for a pair of communication
    ops each of which is the other's gradient (all-to-all one way and back, gather and
    reduce-scatter); `args` are not differentiated."""
    return _Paired.apply(x, forward, backward, *args)


class _CopyToTensorParallelRegion(torch.autograd.Function):
    """f: identity forward, all-reduce backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return _summed_copy(grad, ctx.group), None


class _ReduceFromTensorParallelRegion(torch.autograd.Function):
    """g: all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return _summed_copy(x, group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _ScatterToTensorParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the last dim forward; all-gather it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return gather_dim(grad, -1, ctx.group), None


class _GatherFromTensorParallelRegion(torch.autograd.Function):
    """All-gather the last dim forward; keep this rank's slice backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return gather_dim(x, -1, group)

    @staticmethod
    def backward(ctx, grad):
        return split_dim(grad, -1, ctx.group), None


class _ScatterToSequenceParallelRegion(torch.autograd.Function):
    """Keep this rank's slice of the sequence forward; all-gather it backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return split_dim(x, 0, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


class _GatherFromSequenceParallelRegion(torch.autograd.Function):
    """All-gather the sequence forward. Backward reduce-scatters when the consumer is
    tensor-parallel (each rank holds a partial gradient), else keeps this rank's slice."""

    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        if ctx.grad_is_partial:
            return reduce_scatter_dim0(grad, ctx.group), None, None
        return split_dim(grad, 0, ctx.group), None, None


class _ReduceScatterToSequenceParallelRegion(torch.autograd.Function):
    """Reduce-scatter along the sequence forward; all-gather backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_dim0(grad, ctx.group), None


def copy_to_tensor_parallel_region(x, group):
    return x if group_size(group) == 1 else _CopyToTensorParallelRegion.apply(x, group)


def reduce_from_tensor_parallel_region(x, group):
    return x if group_size(group) == 1 else _ReduceFromTensorParallelRegion.apply(x, group)


def scatter_to_tensor_parallel_region(x, group):
    return x if group_size(group) == 1 else _ScatterToTensorParallelRegion.apply(x, group)


def gather_from_tensor_parallel_region(x, group):
    return x if group_size(group) == 1 else _GatherFromTensorParallelRegion.apply(x, group)


def scatter_to_sequence_parallel_region(x, group):
    return x if group_size(group) == 1 else _ScatterToSequenceParallelRegion.apply(x, group)


def gather_from_sequence_parallel_region(x, group, grad_is_partial: bool = True):
    return x if group_size(group) == 1 else _GatherFromSequenceParallelRegion.apply(x, group, grad_is_partial)


def reduce_scatter_to_sequence_parallel_region(x, group):
    return x if group_size(group) == 1 else _ReduceScatterToSequenceParallelRegion.apply(x, group)
