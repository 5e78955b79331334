"""Triton kernels for the (vocab-parallel) cross-entropy: per-row statistics and the gradient.

Statistics: one program per row streams the row's valid columns in BLOCK_V chunks, keeping a
per-lane running max and rescaled sum of exponentials (online softmax with one exp per
element), the sum of logits, and reads the target's logit. Nothing but per-row fp32 scalars
is written. Gradient: one program per (row, column block), written in the logits dtype, in
place into the logits buffer when asked. Each launcher is an operator megalite_kernels::ce_*
(triton_common.kernel_op), with the loss's autograd registered on megalite_kernels::cross_entropy_loss;
on the eager path (triton_common.eager_path) `statistics` and TritonLoss launch the same kernels directly.
"""

import functools

import torch
import triton
import triton.language as tl

from megalite.kernels.cross_entropy_torch import NO_GRAD_BUT_LOGITS, grad_logits_args, setup_loss
from megalite.kernels.cross_entropy_torch import loss_from_statistics as _loss_from_statistics
from megalite.kernels.triton_common import (apply, cdiv, direct, eager_path, kernel_op, op_wrap_triton, reduce_max,
                                            reduce_sum, to_dtype)


@triton.jit
def _local_target(TARGET, row, target_offset, n_valid):
    """The row's target as a column of this shard's valid vocabulary, -1 where it is not one."""
    target = tl.load(TARGET + row) - target_offset
    return tl.where((target >= 0) & (target < n_valid), target, -1)


@triton.jit
def _ce_stats_kernel(LOGITS, TARGET, OUT, n_rows, stride_row, n_valid, target_offset,
                     NEED_SUM: tl.constexpr, MAX_MINUS_TARGET: tl.constexpr, BLOCK_V: tl.constexpr):
    """OUT: [max | sum exp(z - max) | z_target (max - z_target with MAX_MINUS_TARGET) | (sum z)],
    n_rows each."""
    row = tl.program_id(0).to(tl.int64)
    base = LOGITS + row * stride_row
    cols = tl.arange(0, BLOCK_V)
    # The running max starts finite (-3e38, below any real logit) so that max - max is never
    # inf - inf; a row with no valid column ends with that max and a zero sum.
    m_lane = tl.full([BLOCK_V], -3.0e38, dtype=tl.float32)
    s_lane = tl.full([BLOCK_V], 0.0, dtype=tl.float32)
    zsum_lane = tl.full([BLOCK_V], 0.0, dtype=tl.float32)
    for start in range(0, n_valid, BLOCK_V):
        ok = start + cols < n_valid
        z = tl.load(base + start + cols, mask=ok, other=float("-inf")).to(tl.float32)
        # One exp per element: whichever of (z, running max) is smaller is scaled by the other.
        e = tl.exp(-tl.abs(z - m_lane))
        bigger = z > m_lane
        s_lane = tl.where(bigger, s_lane * e + 1.0, s_lane + e)
        m_lane = tl.maximum(m_lane, z)
        if NEED_SUM:
            zsum_lane += tl.where(ok, z, 0.0)
    m = reduce_max(m_lane, axis=0)
    tl.store(OUT + row, m)
    tl.store(OUT + n_rows + row, reduce_sum(s_lane * tl.exp(m_lane - m), axis=0))
    if NEED_SUM:
        tl.store(OUT + 3 * n_rows + row, reduce_sum(zsum_lane, axis=0))
    target = _local_target(TARGET, row, target_offset, n_valid)
    z_t = tl.load(base + tl.maximum(target, 0), mask=target >= 0, other=0.0).to(tl.float32)
    z_t = tl.where(target >= 0, z_t, 0.0)
    if MAX_MINUS_TARGET:
        z_t = m - z_t  # the loss's (max - z_target), as loss_from_statistics computes it
    tl.store(OUT + 2 * n_rows + row, z_t)


@triton.jit
def _ce_grad_kernel(LOGITS, GRAD, TARGET, ROW_MAX, LOG_SUM, GRAD_LOSS, SMOOTH, stride_row, stride_grad, n_cols,
                    n_valid, target_offset, target_weight, smooth_value, BLOCK_V: tl.constexpr):
    """SMOOTH: a 1-element tensor holding label_smoothing / V (the sharded statistics' V is a
    device value), or None for the float smooth_value."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    in_row = cols < n_cols
    valid = cols < n_valid
    z = tl.load(LOGITS + row * stride_row + cols, mask=valid, other=0.0).to(tl.float32)
    row_max = tl.load(ROW_MAX + row)
    log_sum = tl.load(LOG_SUM + row)
    g = tl.load(GRAD_LOSS + row)
    target = _local_target(TARGET, row, target_offset, n_valid)
    if SMOOTH is None:
        smooth_weight = smooth_value
    else:
        smooth_weight = tl.load(SMOOTH)
    # d loss / d z_j = softmax_j - (1 - eps) [j == target] - eps / V on the real vocabulary, 0 on padding.
    # softmax as exp((z - max) - log sum): exact where max + log sum would round at large logits.
    grad = tl.exp((z - row_max) - log_sum) - smooth_weight - tl.where(cols == target, target_weight, 0.0)
    grad = tl.where(valid, grad * g, 0.0)
    tl.store(GRAD + row * stride_grad + cols, to_dtype(grad, GRAD.dtype.element_ty), mask=in_row)


@functools.lru_cache(maxsize=256)
def _block_v(n: int) -> tuple[int, int]:
    block = min(4096, triton.next_power_of_2(max(n, 1)))
    return block, max(1, min(8, block // 256))


def _launch_stats(logits2d, target, out, n_valid, target_offset, need_sum, max_minus_target, wrap_triton):
    """out: contiguous fp32 [3 or 4, rows]."""
    n_rows = logits2d.shape[0]
    block_v, num_warps = _block_v(n_valid)
    wrap_triton(_ce_stats_kernel)[(n_rows,)](
        logits2d, target, out, n_rows, logits2d.stride(0), n_valid, target_offset,
        NEED_SUM=need_sum, MAX_MINUS_TARGET=max_minus_target, BLOCK_V=block_v, num_warps=num_warps)


def _local_stats(logits2d, local_target, n_valid, need_sum, wrap_triton):
    out = torch.empty((4 if need_sum else 3, logits2d.shape[0]), dtype=torch.float32, device=logits2d.device)
    _launch_stats(logits2d, local_target, out, n_valid, 0, need_sum, False, wrap_triton)
    return out


@kernel_op("ce_local_stats", lambda logits2d, local_target, n_valid, need_sum:
                logits2d.new_empty((4 if need_sum else 3, logits2d.shape[0]), dtype=torch.float32))
def local_stats(logits2d: torch.Tensor, local_target: torch.Tensor, n_valid: int, need_sum: bool) -> torch.Tensor:
    """Per-row fp32 statistics over the first `n_valid` columns of logits2d [N, V_local], stacked
    [max, sum exp(z - max), z_target, (sum z if need_sum)] -> [3 or 4, N]; local_target [N] int64
    is -1 where the target is not in this shard (z_target is then 0)."""
    return _local_stats(logits2d, local_target, n_valid, need_sum, op_wrap_triton)


def _launch_grad(logits2d, grad, local_target, row_max, log_sum, grad_loss, n_valid, label_smoothing, smooth,
                 wrap_triton, target_offset=0):
    """local_target: targets less target_offset are this shard's columns (the rest are masked in the
    kernel); smooth: a 1-element tensor, or a float, holding label_smoothing / V."""
    n_rows, n_cols = logits2d.shape
    block_v, num_warps = _block_v(n_cols)
    wrap_triton(_ce_grad_kernel)[(n_rows, cdiv(n_cols, block_v))](
        logits2d, grad, local_target, row_max, log_sum, grad_loss, None if smooth.__class__ is float else smooth,
        logits2d.stride(0), grad.stride(0), n_cols, n_valid, target_offset, 1.0 - label_smoothing,
        smooth if smooth.__class__ is float else 0.0, BLOCK_V=block_v, num_warps=num_warps)


@kernel_op("ce_grad_logits", lambda logits2d, *args: torch.empty_like(logits2d, memory_format=torch.contiguous_format))
def grad_logits(logits2d: torch.Tensor, local_target: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor,
                grad_loss: torch.Tensor, n_valid: int, label_smoothing: float, smooth: torch.Tensor) -> torch.Tensor:
    """Gradient of the loss w.r.t. logits2d [N, V_local], in its dtype, from the rows' global max
    and log sum exp(z - max); smooth is a 1-element fp32 tensor holding label_smoothing / V."""
    grad = torch.empty(logits2d.shape, dtype=logits2d.dtype, device=logits2d.device)
    _launch_grad(logits2d, grad, local_target, row_max, log_sum, grad_loss, n_valid, label_smoothing, smooth,
                 op_wrap_triton)
    return grad


@kernel_op("ce_grad_logits_", lambda *args: None, mutates_args=("logits2d",))
def grad_logits_(logits2d: torch.Tensor, local_target: torch.Tensor, row_max: torch.Tensor, log_sum: torch.Tensor,
                 grad_loss: torch.Tensor, n_valid: int, label_smoothing: float, smooth: torch.Tensor) -> None:
    """grad_logits written into logits2d itself (each element is read before it is overwritten)."""
    _launch_grad(logits2d, logits2d, local_target, row_max, log_sum, grad_loss, n_valid, label_smoothing, smooth,
                 op_wrap_triton)


loss_from_statistics = torch.library.custom_op("megalite_kernels::cross_entropy_loss", _loss_from_statistics,
                                               mutates_args=())
loss_from_statistics.register_fake(lambda logits2d, local_target, global_max, *args: torch.empty_like(global_max))


def _loss_grad(ctx, grad_loss):
    args = grad_logits_args(ctx, grad_loss)
    # Under torch.compile the out-of-place kernel is used: a compiled graph's input is not written.
    if ctx.inplace_backward and not torch.compiler.is_compiling():
        grad_logits_(*args)
        return args[0], *NO_GRAD_BUT_LOGITS
    return grad_logits(*args), *NO_GRAD_BUT_LOGITS


loss_from_statistics.register_autograd(_loss_grad, setup_context=setup_loss)


class TritonLoss(torch.autograd.Function):
    """The eager path of cross_entropy_loss: its gradient kernel launched directly."""

    @staticmethod
    def forward(ctx, *args):  # ctx first, no setup_context: Function.apply then skips binding the arguments
        out = _loss_from_statistics(*args)
        setup_loss(ctx, args, out)
        return out

    @staticmethod
    def backward(ctx, grad_loss):
        args = grad_logits_args(ctx, grad_loss)
        logits2d = args[0]
        grad = logits2d if ctx.inplace_backward else torch.empty(logits2d.shape, dtype=logits2d.dtype,
                                                                 device=logits2d.device)
        _launch_grad(logits2d, grad, *args[1:], direct)
        return grad, *NO_GRAD_BUT_LOGITS


_apply_loss = super(torch.autograd.Function, TritonLoss).apply


def statistics(logits2d: torch.Tensor, local_target: torch.Tensor, n_valid: int, need_sum: bool) -> torch.Tensor:
    """local_stats: the kernel launched directly where triton_common.eager_path allows, else the operator."""
    if eager_path(logits2d, local_target) is None:
        return local_stats(logits2d, local_target, n_valid, need_sum)
    return _local_stats(logits2d, local_target, n_valid, need_sum, direct)


def loss(*args) -> torch.Tensor:
    """loss_from_statistics(*args): TritonLoss where triton_common.eager_path allows, else the operator."""
    if eager_path(*args[:7]) is None:
        return loss_from_statistics(*args)
    return apply(TritonLoss, _apply_loss, *args)


def _unsharded_forward(logits2d, target, vocab_start, valid_vocab, label_smoothing):
    """(loss, statistics [3 or 4, N] whose first row is the row max, log sum exp(z - max)) of an
    unsharded vocabulary from one launch: the statistics kernel masks the global targets itself
    and, without smoothing, writes max - z_target, so that the loss is a log and an add on the
    host. The same numbers as the operator path (cross_entropy._global_statistics, loss_from_statistics)."""
    n_rows = logits2d.shape[0]
    need_sum = label_smoothing > 0
    out = torch.empty((4 if need_sum else 3, n_rows), dtype=torch.float32, device=logits2d.device)
    _launch_stats(logits2d, target, out, valid_vocab, vocab_start, need_sum, not need_sum, direct)
    log_sum_exp = torch.log(out[1])
    if need_sum:
        loss = _loss_from_statistics(logits2d, None, out[0], log_sum_exp, out[2], out[3] / valid_vocab, None,
                                     valid_vocab, label_smoothing, False)
    else:
        loss = log_sum_exp + out[2]  # out[2]: max - z_target
    return loss, out, log_sum_exp


class UnshardedLoss(torch.autograd.Function):
    """The eager path of an unsharded cross-entropy (targets global ids, masked in the kernels):
    one statistics launch and two torch ops forward (_unsharded_forward), one gradient launch back."""

    @staticmethod
    def forward(ctx, logits2d, target, vocab_start, valid_vocab, label_smoothing, inplace_backward):
        loss, stats, log_sum_exp = _unsharded_forward(logits2d, target, vocab_start, valid_vocab, label_smoothing)
        ctx.save_for_backward(logits2d, target, stats, log_sum_exp)
        ctx.meta = (vocab_start, valid_vocab, label_smoothing, inplace_backward)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits2d, target, stats, log_sum_exp = ctx.saved_tensors
        vocab_start, valid_vocab, label_smoothing, inplace_backward = ctx.meta
        grad = logits2d if inplace_backward else torch.empty(logits2d.shape, dtype=logits2d.dtype,
                                                             device=logits2d.device)
        # stats as the row max (its first row); label_smoothing / V as a float, rounded to fp32 at the
        # launch as the operator path's 1-element tensor rounds it
        _launch_grad(logits2d, grad, target, stats, log_sum_exp, grad_loss.float().contiguous(), valid_vocab,
                     label_smoothing, label_smoothing / valid_vocab, direct, vocab_start)
        return grad, None, None, None, None, None


_apply_unsharded = super(torch.autograd.Function, UnshardedLoss).apply


def unsharded_loss(logits2d: torch.Tensor, target: torch.Tensor, vocab_start: int, valid_vocab: int,
                   label_smoothing: float, inplace_backward: bool) -> torch.Tensor | None:
    """The per-token loss of an unsharded vocabulary (target: contiguous global ids [N]) on the eager
    path; None where triton_common.eager_path says the operators must run."""
    grad = eager_path(logits2d, target)
    if grad is None:
        return None
    if grad:
        return apply(UnshardedLoss, _apply_unsharded, logits2d, target, vocab_start, valid_vocab, label_smoothing,
                     inplace_backward)
    return _unsharded_forward(logits2d, target, vocab_start, valid_vocab, label_smoothing)[0]
