"""Sequence-parallel linears whose tensor-parallel collective is split and overlapped with the
GEMM (--tp-comm-overlap), the work Transformer Engine's userbuffers do for Megatron, built on
ordinary torch.distributed collectives so that it runs on gloo as on NCCL.

Two collectives meet a GEMM under sequence parallelism (t ranks, each holding s/t rows):

  all-gather, then GEMM    column-parallel forward, row-parallel input gradient
  GEMM, then reduce-scatter  row-parallel forward, column-parallel input gradient

Each is split one of two ways (TE's methods):
  - "pipeline": the rows are cut into `num_splits` chunks; chunk c+1's collective is in flight
    while chunk c's GEMM runs (all-gathers launched one ahead, reduce-scatters as each chunk's
    partial product is ready).
  - "ring_exchange": t steps around the TP ring with point-to-point transfers. All-gather:
    each rank multiplies the shard it holds while passing it to its neighbour. Reduce-scatter:
    each rank multiplies the block its neighbour needs next and adds it to the partial sum it
    received, so after t steps every rank holds the sum of its own block.
The third, "bulk" (column-parallel backward: the input's all-gather during the input-gradient
GEMM, that gradient's reduce-scatter during the weight-gradient GEMM), is linear_function.py's.

Rows are never mixed, so every output row is the GEMM of the same row as on the plain path;
only the order in which the reduce-scatter sums the t partial rows may differ.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel import comm
from megalite.parallel.tensor.gemm import weight_gradient
from megalite.parallel.tensor.linear_function import bulk_backward, engine_nodes, wanted_gradients


def _exchange(send: torch.Tensor, recv: torch.Tensor, group) -> list:
    """Send to the previous rank of the ring and receive from the next, asynchronously."""
    n, r = comm.group_size(group), comm.group_rank(group)
    return dist.batch_isend_irecv([dist.P2POp(dist.isend, send, group=group, group_peer=(r - 1) % n),
                                   dist.P2POp(dist.irecv, recv, group=group, group_peer=(r + 1) % n)])


def _row_chunks(rows: int, splits: int) -> list[tuple[int, int]]:
    """[start, end) of `splits` near-equal chunks of `rows` rows (no empty chunk)."""
    bounds = torch.linspace(0, rows, min(splits, rows) + 1).round().long().tolist()
    return list(zip(bounds[:-1], bounds[1:]))


def all_gather_linear(x, weight, bias, group, method: str, num_splits: int, keep_input: bool = False):
    """F.linear(all_gather(x) along dim 0, weight, bias) with the all-gather overlapped; also
    the gathered input when `keep_input` (else None). x: this rank's [m, ...] rows."""
    n, r, m = comm.group_size(group), comm.group_rank(group), x.shape[0]
    out = x.new_empty((n, m, *x.shape[1:-1], weight.shape[0]))
    total = x.new_empty((n, *x.shape)) if keep_input else None
    x = x.contiguous()
    if method == "ring_exchange":
        current = x
        for step in range(n):  # at step i this rank holds rank (r + i)'s shard
            owner = (r + step) % n
            if step + 1 < n:
                following = torch.empty_like(current)
                works = _exchange(current, following, group)
            out[owner] = F.linear(current, weight, bias)
            if keep_input:
                total[owner] = current
            if step + 1 < n:
                for work in works:
                    work.wait()
                current = following
    elif method == "pipeline":
        chunks = _row_chunks(m, num_splits)

        def start(c):
            a, b = chunks[c]
            gathered = x.new_empty((n * (b - a), *x.shape[1:]))
            work = dist.all_gather_single(gathered, x[a:b], group=group, async_op=True)
            return gathered.view(n, b - a, *x.shape[1:]), work
        pending = start(0)
        for c, (a, b) in enumerate(chunks):
            gathered, work = pending
            if c + 1 < len(chunks):
                pending = start(c + 1)
            work.wait()
            out[:, a:b] = F.linear(gathered, weight, bias)
            if keep_input:
                total[:, a:b] = gathered
    else:
        raise ValueError(f"tp-comm-overlap: all-gather method {method!r} is not ring_exchange or pipeline")
    flat = (n * m, *out.shape[2:])
    return out.view(flat), (total.view(n * m, *x.shape[1:]) if keep_input else None)


def linear_reduce_scatter(x, weight, group, method: str, num_splits: int):
    """reduce_scatter(F.linear(x, weight)) along dim 0 over `group` with the reduce-scatter
    overlapped: this rank's [s/t, ...] rows of the sum of every rank's partial product."""
    n, r = comm.group_size(group), comm.group_rank(group)
    m = x.shape[0] // n
    blocks = x.view(n, m, *x.shape[1:])
    if method == "ring_exchange":
        partial = F.linear(blocks[(r + 1) % n], weight)
        for step in range(1, n):  # the sum of block (r + step + 1) over the ranks r+1 ... r+step
            received = torch.empty_like(partial)
            works = _exchange(partial.contiguous(), received, group)
            mine = F.linear(blocks[(r + step + 1) % n], weight)
            for work in works:
                work.wait()
            partial = mine + received
        return partial
    if method != "pipeline":
        raise ValueError(f"tp-comm-overlap: reduce-scatter method {method!r} is not ring_exchange or pipeline")
    out = x.new_empty((m, *x.shape[1:-1], weight.shape[0]))
    pending = []
    for a, b in _row_chunks(m, num_splits):
        partial = F.linear(blocks[:, a:b], weight).contiguous()
        work = comm.reduce_scatter_into(out[a:b], partial.view(n * (b - a), *partial.shape[2:]), group,
                                        async_op=True)
        pending.append((work, partial))  # the partial product lives until its reduce-scatter is done
    for work, _ in pending:
        work.wait()
    return out


class _ColumnParallelOverlapped(torch.autograd.Function):
    """Y = all_gather(x) W^T + b, the gather overlapped; saves only x (see linear_function.py).
    The overlapped GEMMs are the 16-bit ones; the weight gradient goes through gemm.py's sink."""

    @staticmethod
    def forward(ctx, x, weight, bias, group, overlap):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.overlap, ctx.has_bias = group, overlap, bias is not None
        ctx.nodes = engine_nodes(x, weight)
        ctx.param = None if ctx.nodes is None else weight  # see engine_nodes
        return all_gather_linear(x, weight, bias, group, overlap.fprop.method, overlap.fprop.num_splits)[0]

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_input, want_weight = wanted_gradients(ctx)
        need_weight = want_weight is not False
        need_bias = ctx.needs_input_grad[2] and ctx.has_bias
        dgrad = ctx.overlap.dgrad
        if dgrad.method == "bulk":
            return (*bulk_backward(x, weight, grad, ctx.group, need_input, want_weight, need_bias, param=ctx.param),
                    None, None)
        n = comm.group_size(ctx.group)
        if need_weight:  # gathered again while the input gradient is formed and scattered
            total = x.new_empty((n * x.shape[0], *x.shape[1:]))
            gathering = dist.all_gather_single(total, x.contiguous(), group=ctx.group, async_op=True)
        grad_x = linear_reduce_scatter(grad, weight.t(), ctx.group, dgrad.method, dgrad.num_splits) \
            if need_input else None
        grad2d = grad.reshape(-1, grad.shape[-1])
        grad_weight = None
        if need_weight:
            gathering.wait()
            grad_weight = weight_gradient(ctx.param, want_weight, grad2d, total.reshape(-1, total.shape[-1]))
        return grad_x, grad_weight, grad2d.sum(0) if need_bias else None, None, None


class _RowParallelOverlapped(torch.autograd.Function):
    """Y = reduce_scatter(x W^T) along the sequence, the reduce-scatter overlapped."""

    @staticmethod
    def forward(ctx, x, weight, group, overlap):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.overlap = group, overlap
        ctx.nodes = engine_nodes(x, weight)
        ctx.param = None if ctx.nodes is None else weight  # see engine_nodes
        return linear_reduce_scatter(x, weight, group, overlap.fprop.method, overlap.fprop.num_splits)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_input, want_weight = wanted_gradients(ctx)
        need_weight = want_weight is not False
        dgrad = ctx.overlap.dgrad
        # the gathered output gradient is both the input-gradient GEMM's input and the weight gradient's
        grad_x, total = all_gather_linear(grad, weight.t(), None, ctx.group, dgrad.method, dgrad.num_splits,
                                          keep_input=need_weight)
        grad_weight = None
        if need_weight:
            grad_weight = weight_gradient(ctx.param, want_weight, total.reshape(-1, total.shape[-1]),
                                          x.reshape(-1, x.shape[-1]))
        return grad_x if need_input else None, grad_weight, None, None


def column_parallel_overlapped(x, weight, bias, group, overlap):
    """The sequence-parallel column-parallel linear with `overlap` (a LinearOverlap)."""
    return _ColumnParallelOverlapped.apply(x, weight, bias, group, overlap)


def row_parallel_overlapped(x, weight, group, overlap):
    """The sequence-parallel row-parallel linear (bias not added) with `overlap`."""
    return _RowParallelOverlapped.apply(x, weight, group, overlap)
