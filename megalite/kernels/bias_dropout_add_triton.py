"""Triton bias-dropout-add, out = residual + dropout(x + bias, p): one elementwise kernel reading
x, the residual and the bias and writing out, registered as the operators
megalite_kernels::bias_dropout_add_forward / ::bias_dropout_add_backward (the first
differentiable through the second) and launched directly by BiasDropoutAddFunction on the eager
path.

The keep mask is never stored. Both kernels draw it from Philox-4x32-10 keyed by a seed the
caller draws from torch's generator (a one-element int64 tensor on the device: no host sync, and
torch's RNG state, forks and checkpoint restores decide it) and a counter per element, so the
backward regenerates exactly the forward's mask. One Philox call gives four 32-bit values and
serves four elements: a row is cut into column blocks of 4 * CHUNK, and element (row, col) takes
value k = (col % (4 CHUNK)) // CHUNK of the call whose counter is
(row * column blocks + col // (4 CHUNK)) * CHUNK + col % CHUNK. CHUNK depends on the row width
alone (chunk_for), so the mask does not depend on how a launch tiles the rows. (One Philox call
per element, tl.rand's and Inductor's way, is about 60 integer instructions an element: on an
H100 that would make this kernel compute-bound near half of copy bandwidth.)

Rounding as the unfused torch ops: x + bias rounded to x's dtype, the dropout's product with the
fp32 scale 1 / (1 - p) rounded (as CUDA's dropout kernel), then the residual add rounded; with
p = 0 the result is residual + (x + bias) bit for bit.
Backward: d residual = d out (the same tensor); dx = d out * keep * scale, rounded; dbias the
column sums of dx in fp32, each program looping over ROWS_PER_PROGRAM rows and writing one row of
partial sums (1/16 of dx's bytes), summed by triton_common.launch_column_sums after.
"""

import functools

import torch
import triton
import triton.language as tl

from megalite.kernels.dispatch import as_rows, rows_of
from megalite.kernels.triton_common import (apply, cached_column_sums_launch, cdiv, direct, eager_path, kernel_op,
                                            launch_column_sums, op_wrap_triton, reduce_sum, to_dtype)

ROWS_PER_PROGRAM = 32  # backward: rows whose dbias partial sums one program writes as one row


@triton.jit
def _philox(c0, c1, c2, c3, k0, k1):
    """Philox-4x32-10 of the counter (c0, c1, c2, c3) under the key (k0, k1), uint32 tensors; the
    constants are Salmon et al.'s (Random123), as in tl.philox, written on builtins so that the
    interpreter runs it whatever mode triton.language was imported in (triton_common.py)."""
    for _ in tl.static_range(10):
        a, b = c0, c2
        c0 = tl.umulhi(0xCD9E8D57, b) ^ c1 ^ k0
        c2 = tl.umulhi(0xD2511F53, a) ^ c3 ^ k1
        c1 = b * 0xCD9E8D57
        c3 = a * 0xD2511F53
        k0 = k0 + 0x9E3779B9
        k1 = k1 + 0xBB67AE85
    return c0, c1, c2, c3


@triton.jit
def _uniform(r):
    """A uint32 as a float in [0, 1) (tl.uint_to_uniform_float's map)."""
    i = r.to(tl.int32, bitcast=True)
    return tl.where(i < 0, -i - 1, i).to(tl.float32) * 4.6566127342e-10


@triton.jit
def _keep_masks(SEED, rows, n_col_blocks, col_block, p, CHUNK: tl.constexpr):
    """The four [rows, CHUNK] keep masks of column block `col_block` (see the module docstring)."""
    seed = tl.load(SEED).to(tl.uint64)
    k0 = (seed & 0xFFFFFFFF).to(tl.uint32)
    k1 = (seed >> 32).to(tl.uint32)
    counter = (rows * n_col_blocks + col_block)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :]
    zero = tl.full(counter.shape, 0, dtype=tl.uint32)
    r0, r1, r2, r3 = _philox((counter & 0xFFFFFFFF).to(tl.uint32), (counter >> 32).to(tl.uint32), zero, zero, k0, k1)
    return _uniform(r0) >= p, _uniform(r1) >= p, _uniform(r2) >= p, _uniform(r3) >= p


@triton.jit
def _fwd_part(X, B, R, OUT, rows, row_ok, cols, n_cols, stride_x, stride_r, keep, scale,
              HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr):
    col_ok = cols < n_cols
    mask = row_ok[:, None] & col_ok[None, :]
    t = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        t = to_dtype(t + tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :],
                     OUT.dtype.element_ty).to(tl.float32)
    if HAS_DROPOUT:
        t = to_dtype(tl.where(keep, t * scale, 0.0), OUT.dtype.element_ty).to(tl.float32)
    r = tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(OUT + rows[:, None] * n_cols + cols[None, :], to_dtype(t + r, OUT.dtype.element_ty), mask=mask)


@triton.jit
def _bda_fwd_kernel(X, B, R, OUT, SEED, n_rows, n_cols, n_col_blocks, stride_x, stride_r, p, scale,
                    HAS_BIAS: tl.constexpr, HAS_DROPOUT: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < n_rows
    col_block = tl.program_id(1)
    cols = col_block * 4 * CHUNK + tl.arange(0, CHUNK)
    if HAS_DROPOUT:
        k0, k1, k2, k3 = _keep_masks(SEED, rows, n_col_blocks, col_block, p, CHUNK)
    else:
        k0 = row_ok[:, None]  # unused without dropout
        k1 = k0
        k2 = k0
        k3 = k0
    _fwd_part(X, B, R, OUT, rows, row_ok, cols, n_cols, stride_x, stride_r, k0, scale, HAS_BIAS, HAS_DROPOUT)
    _fwd_part(X, B, R, OUT, rows, row_ok, cols + CHUNK, n_cols, stride_x, stride_r, k1, scale, HAS_BIAS, HAS_DROPOUT)
    _fwd_part(X, B, R, OUT, rows, row_ok, cols + 2 * CHUNK, n_cols, stride_x, stride_r, k2, scale, HAS_BIAS,
              HAS_DROPOUT)
    _fwd_part(X, B, R, OUT, rows, row_ok, cols + 3 * CHUNK, n_cols, stride_x, stride_r, k3, scale, HAS_BIAS,
              HAS_DROPOUT)


@triton.jit
def _bwd_part(DY, DX, rows, row_ok, cols, n_cols, stride_dy, keep, scale):
    """dx of one [rows, CHUNK] part, stored; returns its rounded values in fp32 (0 outside)."""
    mask = row_ok[:, None] & (cols < n_cols)[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    dx = to_dtype(tl.where(keep & mask, dy * scale, 0.0), DX.dtype.element_ty)
    tl.store(DX + rows[:, None] * n_cols + cols[None, :], dx, mask=mask)
    return dx.to(tl.float32)


@triton.jit
def _bda_bwd_kernel(DY, DX, SEED, DB_PART, n_rows, n_cols, n_col_blocks, stride_dy, p, scale,
                    HAS_BIAS: tl.constexpr, ROWS_PER_PROGRAM: tl.constexpr, BLOCK_M: tl.constexpr,
                    CHUNK: tl.constexpr):
    """dx of ROWS_PER_PROGRAM rows of one column block; with a bias, their fp32 column sums as row
    program_id(0) of DB_PART."""
    pid_m = tl.program_id(0)
    col_block = tl.program_id(1)
    cols = col_block * 4 * CHUNK + tl.arange(0, CHUNK)
    # dbias: the tiles' dx summed elementwise over the loop (no cross-warp sum per block: the
    # first bias-GeLU backward's doing so ran at 21% of copy bandwidth), reduced over rows once
    a0 = tl.full([BLOCK_M, CHUNK], 0.0, dtype=tl.float32)
    a1 = a0
    a2 = a0
    a3 = a0
    for sub in range(ROWS_PER_PROGRAM // BLOCK_M):
        rows = pid_m.to(tl.int64) * ROWS_PER_PROGRAM + sub * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        k0, k1, k2, k3 = _keep_masks(SEED, rows, n_col_blocks, col_block, p, CHUNK)
        a0 += _bwd_part(DY, DX, rows, row_ok, cols, n_cols, stride_dy, k0, scale)
        a1 += _bwd_part(DY, DX, rows, row_ok, cols + CHUNK, n_cols, stride_dy, k1, scale)
        a2 += _bwd_part(DY, DX, rows, row_ok, cols + 2 * CHUNK, n_cols, stride_dy, k2, scale)
        a3 += _bwd_part(DY, DX, rows, row_ok, cols + 3 * CHUNK, n_cols, stride_dy, k3, scale)
    if HAS_BIAS:
        part = DB_PART + pid_m * n_cols + cols
        tl.store(part, reduce_sum(a0, axis=0), mask=cols < n_cols)
        tl.store(part + CHUNK, reduce_sum(a1, axis=0), mask=cols + CHUNK < n_cols)
        tl.store(part + 2 * CHUNK, reduce_sum(a2, axis=0), mask=cols + 2 * CHUNK < n_cols)
        tl.store(part + 3 * CHUNK, reduce_sum(a3, axis=0), mask=cols + 3 * CHUNK < n_cols)


def chunk_for(n_cols: int) -> int:
    """Columns one Philox value covers in a column block (a block is four of them): a quarter of
    the row rounded up to a power of two, 16 to 256. The mask depends on it, and on nothing else
    of the launch."""
    return max(16, min(256, triton.next_power_of_2(cdiv(n_cols, 4))))


def tiles(n_rows: int, n_cols: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, CHUNK, column blocks, num_warps): about 4096 elements a program (at most
    ROWS_PER_PROGRAM rows, which the backward's loop needs), 8 a thread in each quarter (16-byte
    loads of 16-bit values)."""
    chunk = chunk_for(n_cols)
    block_m = max(1, min(4096 // (4 * chunk), ROWS_PER_PROGRAM, triton.next_power_of_2(max(n_rows, 1))))
    return block_m, chunk, cdiv(n_cols, 4 * chunk), max(1, min(16, block_m * chunk // 256))


_cached_tiles = functools.lru_cache(maxsize=256)(tiles)


def _launch_forward(x, bias, residual, out, seed, p, rows, launch, wrap_triton):
    """rows: (n_rows, n_cols, row stride of x, row stride of the residual); out is contiguous."""
    n_rows, n_cols, stride_x, stride_r = rows
    block_m, chunk, col_blocks, num_warps = launch
    wrap_triton(_bda_fwd_kernel)[(cdiv(n_rows, block_m), col_blocks)](
        x, bias, residual, out, seed, n_rows, n_cols, col_blocks, stride_x, stride_r, p, 1.0 / (1.0 - p),
        HAS_BIAS=bias is not None, HAS_DROPOUT=p > 0, BLOCK_M=block_m, CHUNK=chunk, num_warps=num_warps)
    return out


def _launch_backward(dy, stride_dy, dx, seed, p, dbias, launch, wrap_triton):
    """dx (contiguous) and dbias [h] (None without a bias; fp32 on the operator path, the bias's
    dtype on the eager path) are written, dbias from the programs' fp32 partials by a second launch."""
    has_bias = dbias is not None
    n_cols = dy.shape[-1]
    n_rows = dy.numel() // n_cols
    block_m, chunk, col_blocks, num_warps = launch
    programs = cdiv(n_rows, ROWS_PER_PROGRAM)
    db_part = dy.new_empty((programs, n_cols), dtype=torch.float32) if has_bias else None
    wrap_triton(_bda_bwd_kernel)[(programs, col_blocks)](
        dy, dx, seed, db_part, n_rows, n_cols, col_blocks, stride_dy, p, 1.0 / (1.0 - p),
        HAS_BIAS=has_bias, ROWS_PER_PROGRAM=ROWS_PER_PROGRAM, BLOCK_M=block_m, CHUNK=chunk, num_warps=num_warps)
    if has_bias:
        launch_column_sums(db_part, None, dbias, None, cached_column_sums_launch(programs, n_cols), wrap_triton)


def _forward_fake(x2d, bias, residual2d, seed, p):
    return torch.empty_like(x2d, memory_format=torch.contiguous_format)


@kernel_op("bias_dropout_add_forward", _forward_fake)
def bias_dropout_add_forward(x2d: torch.Tensor, bias: torch.Tensor | None, residual2d: torch.Tensor,
                             seed: torch.Tensor | None, p: float) -> torch.Tensor:
    """x2d, residual2d [N, h] (unit stride along h), bias [h] or None, seed int64 [1] (None when
    p = 0) -> residual + dropout(x + bias, p) [N, h]."""
    n_rows, n_cols = x2d.shape
    out = torch.empty((n_rows, n_cols), dtype=x2d.dtype, device=x2d.device)
    return _launch_forward(x2d, bias, residual2d, out, seed, p,
                           (n_rows, n_cols, x2d.stride(0), residual2d.stride(0)), tiles(n_rows, n_cols), op_wrap_triton)


def _backward_fake(dy2d, seed, p, has_bias):
    return torch.empty_like(dy2d, memory_format=torch.contiguous_format), \
        dy2d.new_empty(dy2d.shape[1] if has_bias else 0, dtype=torch.float32)


@kernel_op("bias_dropout_add_backward", _backward_fake)
def bias_dropout_add_backward(dy2d: torch.Tensor, seed: torch.Tensor, p: float,
                              has_bias: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx [N, h] in dy's dtype, dbias fp32 [h] (empty without a bias)) of a forward with p > 0."""
    n_rows, n_cols = dy2d.shape
    dx = torch.empty((n_rows, n_cols), dtype=dy2d.dtype, device=dy2d.device)
    dbias = dx.new_empty(n_cols if has_bias else 0, dtype=torch.float32)
    _launch_backward(dy2d, dy2d.stride(0), dx, seed, p, dbias if has_bias else None, tiles(n_rows, n_cols),
                     op_wrap_triton)
    return dx, dbias


def _column_sums(dy: torch.Tensor) -> torch.Tensor:
    """dbias without dropout: d out summed over every dim but the last, in fp32."""
    return dy.reshape(-1, dy.shape[-1]).sum(0, dtype=torch.float32)


def _setup(ctx, inputs, output):
    _, bias, _, seed, ctx.p = inputs
    ctx.save_for_backward(seed)
    ctx.bias_dtype = None if bias is None else bias.dtype


def _grad(ctx, dy2d):
    (seed,) = ctx.saved_tensors
    has_bias = ctx.bias_dtype is not None
    if ctx.p > 0:
        dx, dbias = bias_dropout_add_backward(as_rows(dy2d), seed, ctx.p, has_bias)
    else:
        dx, dbias = dy2d, _column_sums(dy2d) if has_bias else None
    dbias = dbias.to(ctx.bias_dtype) if has_bias and ctx.needs_input_grad[1] else None
    return dx, dbias, dy2d, None, None


bias_dropout_add_forward.register_autograd(_grad, setup_context=_setup)


def _eager_forward(x, bias, residual, seed, p):
    x_rows, n_rows, stride_x = rows_of(x)
    r_rows, _, stride_r = rows_of(residual)
    n_cols = x.shape[-1]
    out = x.new_empty(x.shape)
    return _launch_forward(x_rows, bias, r_rows, out, seed, p, (n_rows, n_cols, stride_x, stride_r),
                           _cached_tiles(n_rows, n_cols), direct)


class BiasDropoutAddFunction(torch.autograd.Function):
    """The eager path of bias_dropout_add_forward / _backward (triton_common.eager_path says when)."""

    @staticmethod
    def forward(ctx, x, bias, residual, seed, p):
        ctx.save_for_backward(seed)
        ctx.meta = (p, None if bias is None else bias.dtype)
        return _eager_forward(x, bias, residual, seed, p)

    @staticmethod
    def backward(ctx, dy):
        (seed,) = ctx.saved_tensors
        p, bias_dtype = ctx.meta
        has_bias = bias_dtype is not None
        if p > 0:
            dy_rows, n_rows, stride_dy = rows_of(dy)
            dx = dy.new_empty(dy.shape)
            dbias = dy.new_empty(dy.shape[-1], dtype=bias_dtype) if has_bias else None
            _launch_backward(dy_rows, stride_dy, dx, seed, p, dbias, _cached_tiles(n_rows, dy.shape[-1]), direct)
        else:
            needed = has_bias and ctx.needs_input_grad[1]
            dx, dbias = dy, _column_sums(dy).to(bias_dtype) if needed else None
        dbias = dbias if ctx.needs_input_grad[1] else None
        return dx, dbias, dy, None, None


_apply = super(torch.autograd.Function, BiasDropoutAddFunction).apply


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, seed: torch.Tensor | None,
                     p: float) -> torch.Tensor:
    """residual + dropout(x + bias, p) in x's shape: the eager path where triton_common.eager_path
    allows, else the operator."""
    grad = eager_path(x, bias, residual)
    if grad is None:
        return bias_dropout_add_forward(as_rows(x), bias, as_rows(residual), seed, p).view(x.shape)
    if grad:
        return apply(BiasDropoutAddFunction, _apply, x, bias, residual, seed, p)
    return _eager_forward(x, bias, residual, seed, p)
