"""Megatron's --defer-embedding-wgrad-compute: the output layer's weight-gradient GEMM of the
first `limit` micro-batches of a step (every micro-batch with limit 0, --wgrad-deferral-limit)
is left out of their backward and computed once all of them are done, so the last pipeline
stage sends its input gradients back sooner and the GEMMs fill the pipeline flush.

As Megatron-Core does it: ColumnParallelLinear keeps the input of each deferred micro-batch
(its sequence shard under sequence parallelism), its backward keeps the output gradient
instead of forming the weight gradient (tensor_parallel/layers.py,
LinearWithGradAccumulationAndAsyncCommunication.backward, `grad_output_buffer`), and the
flush computes the kept pairs, all-gathering each input again while the previous GEMM runs
(core/utils.py drain_embedding_wgrad_compute, called from pipeline_parallel/schedules.py
finish_embedding_wgrad_compute before finalize_model_grads). megalite drains in
DistributedDataParallel.finish_grad_sync, the first thing finalize_model_grads does.

    deferral = defer_wgrad(model.output_layer, limit=2)
    ...forward / backward of every micro-batch...
    deferral.drain()    # adds the deferred GEMMs into weight.main_grad (or .grad); with gradient
                        # accumulation fusion inside the GEMM (gemm.py)

Each deferred GEMM is the one the plain backward would form (same dtype) added to the same
gradient, so only the order of the additions changes.
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel import comm
from megalite.parallel.tensor.gemm import DEFAULT_GEMM, fuses_into_main_grad


class WgradDeferral:
    """The deferred (input, output gradient) pairs of one linear layer for the current step."""

    def __init__(self, limit: int, group, sequence_parallel: bool, gemm=DEFAULT_GEMM):
        if limit < 0:
            raise ValueError(f"--wgrad-deferral-limit must not be negative, got {limit}")
        self.limit, self.group, self.sequence_parallel = limit, group, sequence_parallel
        self.gemm = gemm  # the layer's GEMM strategy (gemm.py), for the drained weight gradients
        self.pending: list[list] = []  # [input, weight, output gradient (None until backward)]

    def takes_another(self) -> bool:
        """Whether the next micro-batch's weight gradient is deferred (Megatron: limit 0, or
        fewer than `limit` already kept this step)."""
        return self.limit == 0 or len(self.pending) < self.limit

    def keep(self, x: torch.Tensor, weight: torch.Tensor) -> list:
        weight.wgrad_deferred = True  # its DDP bucket waits for drain() (see is_wgrad_deferred)
        entry = [x.detach(), weight, None]
        self.pending.append(entry)
        return entry

    @torch.no_grad()
    def drain(self) -> None:
        """Form every kept weight gradient and add it to the weight's main_grad (or .grad)."""
        if any(grad is None for _, _, grad in self.pending):
            raise RuntimeError("--defer-embedding-wgrad-compute: a micro-batch's output layer ran forward with "
                               "gradients enabled but had no backward before the step's gradient sync")
        pending, self.pending = self.pending, []
        gathering = self._gather(pending[0][0]) if pending else None
        for i, (_, weight, grad) in enumerate(pending):
            total, work = gathering
            if i + 1 < len(pending):  # the next input is gathered while this GEMM runs
                gathering = self._gather(pending[i + 1][0])
            if work is not None:
                work.wait()
            grad2d, total2d = grad.reshape(-1, grad.shape[-1]), total.reshape(-1, total.shape[-1])
            if fuses_into_main_grad(weight):  # gradient accumulation fusion
                self.gemm.wgrad_accumulate(weight.main_grad, grad2d, total2d)
                weight.grad_added_to_main_grad = True
                continue
            grad_weight = self.gemm.wgrad(grad2d, total2d)
            target = getattr(weight, "main_grad", None)
            if target is not None:
                target.add_(grad_weight)
            elif weight.grad is None:
                weight.grad = grad_weight
            else:
                weight.grad.add_(grad_weight)

    def _gather(self, x: torch.Tensor):
        """(the full input, the work to wait on): all-gathered along the sequence under sequence
        parallelism, else x itself."""
        n = comm.group_size(self.group)
        if not self.sequence_parallel or n == 1:
            return x, None
        total = x.new_empty((n * x.shape[0], *x.shape[1:]))
        return total, dist.all_gather_single(total, x.contiguous(), group=self.group, async_op=True)


class _LinearWithDeferredWgrad(torch.autograd.Function):
    """F.linear over the (gathered, under sequence parallelism) input whose backward keeps the
    output gradient for the deferral instead of forming the weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, entry, group, sequence_parallel):
        ctx.save_for_backward(weight)
        ctx.entry, ctx.group, ctx.sequence_parallel = entry, group, sequence_parallel
        ctx.has_bias, ctx.rows = bias is not None, x.shape[0]
        total = comm.all_gather_dim0(x, group) if sequence_parallel else x
        return F.linear(total, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        (weight,) = ctx.saved_tensors
        ctx.entry[2] = grad.detach()
        grad_x = grad.matmul(weight)  # the deferred layer's GEMMs are its 16-bit ones
        if ctx.sequence_parallel:
            out = grad_x.new_empty((ctx.rows, *grad_x.shape[1:]))
            comm.reduce_scatter_into(out, grad_x.contiguous(), ctx.group)
            grad_x = out
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, None, grad_bias, None, None, None


def linear_with_deferred_wgrad(x, weight, bias, deferral: WgradDeferral) -> torch.Tensor:
    """The column-parallel linear's forward (x replicated, or its sequence shard under sequence
    parallelism) with this micro-batch's weight gradient deferred; the caller checked
    `deferral.takes_another()`."""
    entry = deferral.keep(x, weight)
    if not deferral.sequence_parallel:
        x = comm.copy_to_tensor_parallel_region(x, deferral.group)
    sequence_parallel = deferral.sequence_parallel and comm.group_size(deferral.group) > 1
    return _LinearWithDeferredWgrad.apply(x, weight, bias, entry, deferral.group, sequence_parallel)


def defer_wgrad(layer, limit: int) -> WgradDeferral:
    """Defer `layer`'s (a ColumnParallelLinear) weight gradient; returns its deferral."""
    layer.wgrad_deferral = WgradDeferral(limit, layer.tp_group, layer.sequence_parallel, layer.gemm)
    return layer.wgrad_deferral


def deferrals_in(module) -> list[WgradDeferral]:
    """The deferrals of `module`'s layers (for DistributedDataParallel.finish_grad_sync)."""
    return [m.wgrad_deferral for m in module.modules() if getattr(m, "wgrad_deferral", None) is not None]


def is_wgrad_deferred(param) -> bool:
    """Whether `param`'s gradient is (partly) formed by a deferral's drain()."""
    return getattr(param, "wgrad_deferred", False)
