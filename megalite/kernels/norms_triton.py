"""Triton RMSNorm / LayerNorm: one-pass row kernels with the row held in registers, registered
as the operators megalite_kernels::norm_forward and ::norm_backward, the first differentiable
through the second, and launched directly by NormFunction on the eager path.

Both are memory-bound: the row is read once into registers (loads of 16 bytes, with pointers
and strides divisible by 16), reduced across the program's warps, and written once.
Forward: a program normalises BLOCK_M rows of h = n_cols <= BLOCK_N columns (about 4096 values
a program, 16 a thread), writing y and the per-row fp32 rstd (and mean for LayerNorm).
Backward: a fixed number of persistent programs (as many as fit on the GPU at once) loop over
the rows, write dx and keep fp32 partial sums of dweight/dbias in registers; a second small
kernel (triton_common.launch_column_sums) sums the [programs, h] partials and writes
dweight/dbias (in the parameters' dtypes on the eager path), not a torch sum and cast each.
"""

import functools

import torch
import triton
import triton.language as tl

from megalite.kernels.dispatch import as_rows, rows_of
from megalite.kernels.triton_common import (apply, cached_sm_count, cdiv, column_sums_launch, direct, eager_path,
                                            kernel_op, launch_column_sums, op_wrap_triton, persistent_programs,
                                            reduce_sum, rows_per_program, sm_count, to_dtype, warps_for)


@triton.jit
def _norm_fwd_kernel(X, W, B, Y, MEAN, RSTD, n_rows, n_cols, stride_x, stride_y, eps,
                     IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_ok = rows < n_rows
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if IS_RMS:
        rstd = 1.0 / tl.sqrt(reduce_sum(x * x, axis=1) / n_cols + eps)
        xhat = x * rstd[:, None]
    else:
        mean = reduce_sum(x, axis=1) / n_cols
        xc = tl.where(mask, x - mean[:, None], 0.0)
        rstd = 1.0 / tl.sqrt(reduce_sum(xc * xc, axis=1) / n_cols + eps)
        xhat = xc * rstd[:, None]
        tl.store(MEAN + rows, mean, mask=row_ok)
    tl.store(RSTD + rows, rstd, mask=row_ok)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    if IS_RMS:
        # Llama order: the normalised row is rounded to the activation dtype before the weight.
        xhat = to_dtype(xhat, Y.dtype.element_ty).to(tl.float32)
    y = xhat * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], to_dtype(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _norm_bwd_kernel(X, W, DY, DX, MEAN, RSTD, DW_PART, DB_PART, n_rows, n_cols,
                     stride_x, stride_dy, stride_dx,
                     IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    dw_acc = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
    db_acc = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
    for block in range(pid, (n_rows + BLOCK_M - 1) // BLOCK_M, tl.num_programs(0)):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        # The weight is re-read per block (from L1) rather than held: registers go to the sums.
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        # w * dy goes through a select before both of its uses: rounded once, the same value in
        # the row sum and in the difference below (a fused multiply-add there would keep the
        # exact product and leave its rounding error, times rstd, where the answer is 0).
        wdy = tl.where(mask, w[None, :] * dy, 0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        c1 = reduce_sum(xhat * wdy, axis=1) / n_cols
        if IS_RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
            # y = w * round(xhat): dweight sees the rounded xhat, dx passes straight through.
            dw_acc += reduce_sum(dy * to_dtype(xhat, DX.dtype.element_ty).to(tl.float32), axis=0)
        else:
            # LayerNorm over one column: xhat = 0 and wdy - c2 = 0 exactly, so dx = 0 exactly.
            c2 = reduce_sum(wdy, axis=1) / n_cols
            dx = ((wdy - c2[:, None]) - xhat * c1[:, None]) * rstd[:, None]
            dw_acc += reduce_sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db_acc += reduce_sum(dy, axis=0)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], to_dtype(dx, DX.dtype.element_ty), mask=mask)
    tl.store(DW_PART + pid * n_cols + cols, dw_acc, mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PART + pid * n_cols + cols, db_acc, mask=col_ok)


def forward_tiles(n_rows: int, n_cols: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps) of the forward: whole rows, 16 fp32 values per thread."""
    block_n = triton.next_power_of_2(n_cols)
    block_m = rows_per_program(block_n, n_rows)
    return block_m, block_n, warps_for(block_m * block_n, 16)


def backward_launch(n_rows: int, n_cols: int, sms: int | None) -> tuple[int, int, int, int]:
    """(programs, BLOCK_M, BLOCK_N, num_warps) of the backward on a GPU of `sms` SMs (None: the
    CPU): each program loops over rows pid, pid + programs, ..., one row at a time (several rows
    a block would put the dweight/dbias sums in a layout shared across rows, which costs
    registers and a layout change every block), accumulating its dweight/dbias partial sums.
    It holds xhat, w * dy, w and the two sums per element: 8 elements per thread stays within 64
    registers up to h = 8192 with no spills (checked by compiling for sm_90), so 32 warps of
    programs fit on an SM at once, which persistent_programs assumes."""
    block_n = triton.next_power_of_2(n_cols)
    num_warps = warps_for(block_n, 8)
    return persistent_programs(n_rows, num_warps, sms), 1, block_n, num_warps


_cached_forward_tiles = functools.lru_cache(maxsize=256)(forward_tiles)


@functools.lru_cache(maxsize=256)
def _backward_plan(n_rows: int, n_cols: int, device_index: int) -> tuple[tuple, tuple]:
    """(backward_launch, column_sums_launch) of the eager backward on CUDA device `device_index`
    (-1: the CPU, under the interpreter), looked up once per shape."""
    device = torch.device("cuda", device_index) if device_index >= 0 else torch.device("cpu")
    launch = backward_launch(n_rows, n_cols, cached_sm_count(device))
    return launch, column_sums_launch(launch[0], n_cols)


def _launch_forward(x, weight, bias, y, mean, rstd, eps, is_rms, rows, tiles, wrap_triton):
    """rows: (n_rows, n_cols, row stride of x); y is contiguous."""
    n_rows, n_cols, stride_x = rows
    block_m, block_n, num_warps = tiles
    wrap_triton(_norm_fwd_kernel)[(cdiv(n_rows, block_m),)](
        x, weight, bias, y, mean, rstd, n_rows, n_cols, stride_x, n_cols, eps,
        IS_RMS=is_rms, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)


def _launch_backward(dy, x, weight, dx, mean, rstd, dw_part, db_part, is_rms, rows, stride_dy, launch, wrap_triton):
    """rows: (n_rows, n_cols, row stride of x); dx is contiguous."""
    n_rows, n_cols, stride_x = rows
    programs, block_m, block_n, num_warps = launch
    wrap_triton(_norm_bwd_kernel)[(programs,)](
        x, weight, dy, dx, mean, rstd, dw_part, db_part, n_rows, n_cols, stride_x, stride_dy, n_cols,
        IS_RMS=is_rms, HAS_BIAS=db_part is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)


def _norm_forward_fake(x2d, weight, bias, eps, is_rms):
    n_rows = x2d.shape[0]
    stats = x2d.new_empty(n_rows, dtype=torch.float32)
    return torch.empty_like(x2d, memory_format=torch.contiguous_format), \
        x2d.new_empty(0 if is_rms else n_rows, dtype=torch.float32), stats


@kernel_op("norm_forward", _norm_forward_fake)
def norm_forward(x2d: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float,
                 is_rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x2d [N, h] (unit stride along h) -> (y [N, h] in x's dtype, mean [N] fp32 (empty for RMSNorm),
    rstd [N] fp32)."""
    n_rows, n_cols = x2d.shape
    y = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    rstd = torch.empty(n_rows, dtype=torch.float32, device=x2d.device)
    mean = torch.empty(0 if is_rms else n_rows, dtype=torch.float32, device=x2d.device)
    _launch_forward(x2d, weight, bias, y, None if is_rms else mean, rstd, eps, is_rms, (n_rows, n_cols, x2d.stride(0)),
                    forward_tiles(n_rows, n_cols), op_wrap_triton)
    return y, mean, rstd


def _norm_backward_fake(dy2d, x2d, weight, has_bias, mean, rstd, is_rms):
    n_cols = x2d.shape[1]
    return torch.empty_like(x2d, memory_format=torch.contiguous_format), \
        x2d.new_empty(n_cols, dtype=torch.float32), x2d.new_empty(n_cols if has_bias else 0, dtype=torch.float32)


@kernel_op("norm_backward", _norm_backward_fake)
def norm_backward(dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, has_bias: bool, mean: torch.Tensor,
                  rstd: torch.Tensor, is_rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx [N, h] in x's dtype, dweight fp32 [h], dbias fp32 [h] (empty without a bias))."""
    n_rows, n_cols = x2d.shape
    launch = backward_launch(n_rows, n_cols, sm_count(x2d.device))
    dx = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    dw_part = torch.empty((launch[0], n_cols), dtype=torch.float32, device=x2d.device)
    db_part = torch.empty((launch[0] if has_bias else 0, n_cols), dtype=torch.float32, device=x2d.device)
    _launch_backward(dy2d, x2d, weight, dx, None if is_rms else mean, rstd, dw_part, db_part if has_bias else None,
                     is_rms, (n_rows, n_cols, x2d.stride(0)), dy2d.stride(0), launch, op_wrap_triton)
    dw = torch.empty(n_cols, dtype=torch.float32, device=x2d.device)
    db = torch.empty(n_cols if has_bias else 0, dtype=torch.float32, device=x2d.device)
    launch_column_sums(dw_part, db_part if has_bias else None, dw, db if has_bias else None,
                       column_sums_launch(launch[0], n_cols), op_wrap_triton)
    return dx, dw, db


def _setup_norm(ctx, inputs, output):
    x2d, weight, bias, _, is_rms = inputs
    _, mean, rstd = output
    ctx.mark_non_differentiable(mean, rstd)
    ctx.save_for_backward(x2d, weight, mean, rstd)
    ctx.is_rms, ctx.has_bias = is_rms, bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype


def _norm_grad(ctx, dy, _dmean, _drstd):
    x2d, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = norm_backward(as_rows(dy), x2d, weight, ctx.has_bias, mean, rstd, ctx.is_rms)
    dw = dw.to(weight.dtype) if ctx.needs_input_grad[1] else None
    db = db.to(ctx.bias_dtype) if ctx.has_bias and ctx.needs_input_grad[2] else None
    return dx, dw, db, None, None


norm_forward.register_autograd(_norm_grad, setup_context=_setup_norm)


def _eager_forward(x, weight, bias, eps, is_rms):
    """(y in x's shape, (x or its [rows, h] copy, rows, row stride), mean or None, rstd)."""
    rows, n_rows, stride_x = rows_of(x)
    n_cols = x.shape[-1]
    y = torch.empty_like(rows) if rows is x else rows.new_empty(x.shape)
    rstd = x.new_empty(n_rows, dtype=torch.float32)
    mean = None if is_rms else x.new_empty(n_rows, dtype=torch.float32)
    _launch_forward(rows, weight, bias, y, mean, rstd, eps, is_rms, (n_rows, n_cols, stride_x),
                    _cached_forward_tiles(n_rows, n_cols), direct)
    return y, (rows, n_rows, stride_x), mean, rstd


class NormFunction(torch.autograd.Function):
    """The eager path of norm_forward / norm_backward: the same kernels launched directly, without
    the operator dispatch and its autograd wrapper (triton_common.eager_path says when)."""

    @staticmethod
    def forward(ctx, x, weight, bias, eps, is_rms):
        y, (x_rows, n_rows, stride_x), mean, rstd = _eager_forward(x, weight, bias, eps, is_rms)
        ctx.save_for_backward(x_rows, weight, mean, rstd)
        ctx.meta = (is_rms, None if bias is None else bias.dtype, n_rows, stride_x, x.shape)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        is_rms, bias_dtype, n_rows, stride_x, shape = ctx.meta
        dy, _, stride_dy = rows_of(dy)
        n_cols = x.shape[-1]
        launch, sums_launch = _backward_plan(n_rows, n_cols, x.get_device())
        dx = torch.empty_like(x) if x.shape == shape else x.new_empty(shape)  # contiguous either way
        dw_part = x.new_empty((launch[0], n_cols), dtype=torch.float32)
        db_part = None if bias_dtype is None else x.new_empty((launch[0], n_cols), dtype=torch.float32)
        _launch_backward(dy, x, weight, dx, mean, rstd, dw_part, db_part, is_rms, (n_rows, n_cols, stride_x),
                         stride_dy, launch, direct)
        dw = x.new_empty(n_cols, dtype=weight.dtype)
        db = None if bias_dtype is None else x.new_empty(n_cols, dtype=bias_dtype)
        launch_column_sums(dw_part, db_part, dw, db, sums_launch, direct)
        needs = ctx.needs_input_grad
        return dx, dw if needs[1] else None, db if needs[2] else None, None, None


_apply_norm = super(torch.autograd.Function, NormFunction).apply


def norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, is_rms: bool) -> torch.Tensor:
    """The norm of x [..., h] over its last dim: the eager path where triton_common.eager_path allows,
    else the operator."""
    grad = eager_path(x, weight, bias)
    if grad is None:
        return norm_forward(as_rows(x), weight, bias, eps, is_rms)[0].view(x.shape)
    if grad:
        return apply(NormFunction, _apply_norm, x, weight, bias, eps, is_rms)
    return _eager_forward(x, weight, bias, eps, is_rms)[0]
