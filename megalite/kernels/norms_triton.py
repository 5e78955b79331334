"""Triton RMSNorm / LayerNorm: one-pass row kernels with the row held in registers, registered
as the operators megalite_kernels::norm_forward and ::norm_backward, the first differentiable
through the second.

Forward: a program normalises BLOCK_M rows of h = n_cols <= BLOCK_N columns, writing y and the
per-row fp32 rstd (and mean for LayerNorm). Backward: a fixed number of programs (a few per SM)
loop over row blocks, write dx and keep fp32 partial sums of dweight/dbias in registers; the
[programs, h] partials are reduced by one small torch sum afterwards.
"""

import torch
import triton
import triton.language as tl

from megalite.kernels.dispatch import as_rows
from megalite.kernels.triton_common import (kernel_op, persistent_programs, reduce_sum, rows_per_program, to_dtype, warps_for,
                                            wrap_triton)


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
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
    db_acc = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
    for block in range(pid, (n_rows + BLOCK_M - 1) // BLOCK_M, tl.num_programs(0)):
        rows = block * BLOCK_M + tl.arange(0, BLOCK_M).to(tl.int64)
        row_ok = rows < n_rows
        mask = row_ok[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        wdy = w[None, :] * dy
        c1 = reduce_sum(xhat * wdy, axis=1) / n_cols
        if IS_RMS:
            dx = (wdy - xhat * c1[:, None]) * rstd[:, None]
            # y = w * round(xhat): dweight sees the rounded xhat, dx passes straight through.
            dw_acc += reduce_sum(dy * to_dtype(xhat, DX.dtype.element_ty).to(tl.float32), axis=0)
        else:
            c2 = reduce_sum(wdy, axis=1) / n_cols
            dx = (wdy - (xhat * c1[:, None] + c2[:, None])) * rstd[:, None]
            dw_acc += reduce_sum(dy * xhat, axis=0)
        if HAS_BIAS:
            db_acc += reduce_sum(dy, axis=0)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], to_dtype(dx, DX.dtype.element_ty), mask=mask)
    tl.store(DW_PART + pid * n_cols + cols, dw_acc, mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PART + pid * n_cols + cols, db_acc, mask=col_ok)


def _tiles(n_rows: int, n_cols: int, elems_per_thread: int) -> tuple[int, int, int]:
    block_n = triton.next_power_of_2(n_cols)
    block_m = rows_per_program(block_n, n_rows)
    return block_m, block_n, warps_for(block_m * block_n, elems_per_thread)


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
    block_m, block_n, num_warps = _tiles(n_rows, n_cols, elems_per_thread=16)
    wrap_triton(_norm_fwd_kernel)[(triton.cdiv(n_rows, block_m),)](
        x2d, weight, bias, y, None if is_rms else mean, rstd, n_rows, n_cols, x2d.stride(0), y.stride(0), eps,
        IS_RMS=is_rms, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return y, mean, rstd


def backward_launch(device: torch.device, n_rows: int, n_cols: int) -> tuple[int, int, int, int]:
    """(programs, BLOCK_M, BLOCK_N, num_warps) of the backward: each program loops over row
    blocks pid, pid + programs, ..., accumulating its dweight/dbias partial sums."""
    # The backward holds x, dy, w and the dweight/dbias sums per element: 8 elements per thread
    # keeps h = 4096 at 64 registers (two 16-warp programs per SM) with no spills.
    block_m, block_n, num_warps = _tiles(n_rows, n_cols, elems_per_thread=8)
    return persistent_programs(device, triton.cdiv(n_rows, block_m), num_warps), block_m, block_n, num_warps


def _norm_backward_fake(dy2d, x2d, weight, has_bias, mean, rstd, is_rms):
    n_cols = x2d.shape[1]
    return torch.empty_like(x2d, memory_format=torch.contiguous_format), \
        x2d.new_empty(n_cols, dtype=torch.float32), x2d.new_empty(n_cols if has_bias else 0, dtype=torch.float32)


@kernel_op("norm_backward", _norm_backward_fake)
def norm_backward(dy2d: torch.Tensor, x2d: torch.Tensor, weight: torch.Tensor, has_bias: bool, mean: torch.Tensor,
                  rstd: torch.Tensor, is_rms: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (dx [N, h] in x's dtype, dweight fp32 [h], dbias fp32 [h] (empty without a bias))."""
    n_rows, n_cols = x2d.shape
    dx = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    programs, block_m, block_n, num_warps = backward_launch(x2d.device, n_rows, n_cols)
    dw_part = torch.empty((programs, n_cols), dtype=torch.float32, device=x2d.device)
    db_part = torch.empty((programs if has_bias else 0, n_cols), dtype=torch.float32, device=x2d.device)
    wrap_triton(_norm_bwd_kernel)[(programs,)](
        x2d, weight, dy2d, dx, None if is_rms else mean, rstd, dw_part, db_part if has_bias else None,
        n_rows, n_cols, x2d.stride(0), dy2d.stride(0), dx.stride(0),
        IS_RMS=is_rms, HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return dx, dw_part.sum(0), db_part.sum(0)


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
