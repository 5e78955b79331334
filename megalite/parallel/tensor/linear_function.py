"""The tensor-parallel linear's autograd Function: every column- and row-parallel linear
multiplies through it (a plain input, or under sequence parallelism the all-gathered input), so
its GEMMs go through the layer's Gemm strategy and its weight gradient through gemm.py's
weight_gradient (accumulated into main_grad with gradient accumulation fusion).

Under sequence parallelism: Y = all_gather(X) A^T + b, where X is this rank's [s/t, b, h] slice
of the sequence. The weight
gradient needs the gathered input, but keeping it would store t times the shard per linear (the
QKV and first MLP projections and the output layer: 3.5·s·b·h bytes per layer more than
Korthikanti et al.'s 34·s·b·h/t at t = 8). As Megatron-LM does, backward gathers the shard
again, overlapped with the input-gradient matmul, and reduce-scatters the input gradient
overlapped with the weight-gradient matmul.
"""

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.tensor.gemm import DEFAULT_GEMM, Gemm, engine_wants, gradient_node, weight_gradient


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


def bulk_backward(x, weight, grad, group, need_input: bool, want_weight: bool | None, need_bias: bool,
                  gemm: Gemm = DEFAULT_GEMM, param=None):
    """(grad_x, grad_weight, grad_bias) of F.linear(all_gather(x), weight, bias): the shard is
    gathered again while the input gradient is formed, and that gradient is reduce-scattered
    while the weight gradient is formed (Transformer Engine's "bulk" overlap). `want_weight`:
    as gemm.weight_gradient's `wanted` (False: no weight gradient); `param`: the weight as
    forward received it (see engine_nodes), default `weight`."""
    n = comm.group_size(group)
    need_weight = want_weight is not False
    if need_weight:
        total = x.new_empty((n * x.shape[0], *x.shape[1:]))
        gathering = _start(dist.all_gather_single, total, x.contiguous(), group)
    grad2d = grad.reshape(-1, grad.shape[-1])
    shared = gemm.shared_grad(grad2d) if need_input and need_weight else None
    grad_total = gemm.dgrad(grad, weight, shared) if need_input else None
    if need_weight:
        _wait(gathering)
    grad_x = scattering = None
    if need_input:
        grad_x = grad_total.new_empty((x.shape[0], *grad_total.shape[1:]))
        scattering = _start(comm.reduce_scatter_into, grad_x, grad_total.contiguous(), group)
    grad_weight = None
    if need_weight:
        grad_weight = weight_gradient(weight if param is None else param, want_weight, grad2d,
                                      total.reshape(-1, total.shape[-1]), gemm, shared)
    grad_bias = grad2d.sum(0) if need_bias else None
    _wait(scattering)
    return grad_x, grad_weight, grad_bias


def wanted_gradients(ctx) -> tuple[bool, bool | None]:
    """(input gradient needed, weight gradient wanted as in weight_gradient) for the running
    backward of a Function whose forward stored ctx.nodes = (gradient_node(x),
    gradient_node(weight)), or None under torch.compile (then needs_input_grad decides)."""
    need_input, need_weight = ctx.needs_input_grad[:2]
    if ctx.nodes is None:
        return need_input, (None if need_weight else False)
    x_node, weight_node = ctx.nodes
    return need_input and engine_wants(x_node) is not False, need_weight and engine_wants(weight_node)


def engine_nodes(x, weight):
    """What a Function's forward stores as ctx.nodes (see wanted_gradients). The Function also
    keeps the weight itself as ctx.param for weight_gradient (None under torch.compile, which
    never fuses): a saved tensor may come back from an activation-recompute checkpoint as
    another tensor object, without main_grad."""
    if torch.compiler.is_compiling():
        return None
    return gradient_node(x), gradient_node(weight)


class _TensorParallelLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, group, gather: bool, gemm: Gemm):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.gather, ctx.gemm, ctx.has_bias = group, gather, gemm, bias is not None
        ctx.nodes = engine_nodes(x, weight)
        ctx.param = None if ctx.nodes is None else weight  # see engine_nodes
        return gemm.fprop(comm.all_gather_dim0(x, group) if gather else x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        need_input, want_weight = wanted_gradients(ctx)
        need_bias = ctx.has_bias and ctx.needs_input_grad[2]
        if ctx.gather:
            grads = bulk_backward(x, weight, grad, ctx.group, need_input, want_weight, need_bias, ctx.gemm, ctx.param)
            return (*grads, None, None, None)
        grad2d = grad.reshape(-1, grad.shape[-1])
        # dy cast once for both GEMMs when this backward runs both (not a zero-bubble B or W pass)
        shared = ctx.gemm.shared_grad(grad2d) if need_input and want_weight is not False else None
        grad_x = ctx.gemm.dgrad(grad, weight, shared) if need_input else None
        grad_weight = None
        if want_weight is not False:
            param = weight if ctx.param is None else ctx.param
            grad_weight = weight_gradient(param, want_weight, grad2d, x.reshape(-1, x.shape[-1]), ctx.gemm, shared)
        return grad_x, grad_weight, grad2d.sum(0) if need_bias else None, None, None, None


def tensor_parallel_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, gemm: Gemm,
                           group=None, gather_input: bool = False) -> torch.Tensor:
    """gemm.fprop(x, weight, bias), with `gather_input` over the all-gathered (along dim 0 over
    `group`) input, saving only x for backward; the input gradient is then reduce-scattered
    (the weight is tensor-parallel: each rank's is partial)."""
    gather = gather_input and comm.group_size(group) > 1
    return _TensorParallelLinear.apply(x, weight, bias, group, gather, gemm)

