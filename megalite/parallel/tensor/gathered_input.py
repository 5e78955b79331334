"""The column-parallel linear under sequence parallelism, saving only the input's shard.

Y = all_gather(X) A^T + b, where X is this rank's [s/t, b, h] slice of the sequence. The weight
gradient needs the gathered input, but keeping it would store t times the shard per linear (the
QKV and first MLP projections and the output layer: 3.5·s·b·h bytes per layer more than
Korthikanti et al.'s 34·s·b·h/t at t = 8). As Megatron-LM does, backward gathers the shard
again, overlapped with the input-gradient matmul, and reduce-scatters the input gradient
overlapped with the weight-gradient matmul.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel import comm


def _start(collective, out: torch.Tensor, x: torch.Tensor, group):
    """Launch `collective(out, x)`: asynchronously (returns the work to wait on), or, while
    torch.compile traces, synchronously (the compiler schedules communication itself)."""
    if torch.compiler.is_compiling():
        collective(out, x, group=group)
        return None
    return collective(out, x, group=group, async_op=True)


def _wait(work) -> None:
    if work is not None:
        work.wait()


def bulk_backward(x, weight, grad, group, need_input: bool, need_weight: bool, need_bias: bool):
    """(grad_x, grad_weight, grad_bias) of F.linear(all_gather(x), weight, bias): the shard is
    gathered again while the input gradient is formed, and that gradient is reduce-scattered
    while the weight gradient is formed (Transformer Engine's "bulk" overlap)."""
    n = comm.group_size(group)
    if need_weight:
        total = x.new_empty((n * x.shape[0], *x.shape[1:]))
        gathering = _start(dist.all_gather_single, total, x.contiguous(), group)
    grad_total = grad.matmul(weight) if need_input else None
    if need_weight:
        _wait(gathering)
    grad_x = scattering = None
    if need_input:
        grad_x = grad_total.new_empty((x.shape[0], *grad_total.shape[1:]))
        scattering = _start(comm.reduce_scatter_into, grad_x, grad_total.contiguous(), group)
    grad2d = grad.reshape(-1, grad.shape[-1])
    grad_weight = grad2d.t().matmul(total.reshape(-1, total.shape[-1])) if need_weight else None
    grad_bias = grad2d.sum(0) if need_bias else None
    _wait(scattering)
    return grad_x, grad_weight, grad_bias


class _LinearWithGatheredInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(comm.all_gather_dim0(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_input, need_weight, need_bias = ctx.needs_input_grad[:3]
        return (*bulk_backward(x, weight, grad, ctx.group, need_input, need_weight, ctx.has_bias and need_bias),
                None)


def linear_with_gathered_input(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                               group) -> torch.Tensor:
    """F.linear(all_gather(x) along dim 0 over `group`, weight, bias), saving only x for backward;
    the input gradient is reduce-scattered (the weight is tensor-parallel: each rank's is partial)."""
    if comm.group_size(group) == 1:
        return F.linear(x, weight, bias)
    return _LinearWithGatheredInput.apply(x, weight, bias, group)
