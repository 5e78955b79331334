"""Triton FP8 cast: one elementwise pass over a contiguous tensor x that writes
fp8(clamp(x * scale, -fp8_max, fp8_max)) and/or max |x| into one fp32 (atomic max of each
program's maximum), registered as the operators megalite_kernels::fp8_cast (cast, optionally
recording the amax; mutates `amax`) and ::fp8_amax (the amax pass alone), and launched directly
on the eager path. ::fp8_cast_transposed (_fp8_cast_t_kernel, tiles of a 2-D x) writes the FP8
copy transposed instead: the column-major operands wgrad's _scaled_mm takes, without a separate
transposing copy (2 bytes an element). ::fp8_cast_transpose (the same kernel with STORE_ROWS,
Transformer Engine's "cast_transpose") writes both copies from one read: the output gradient
that dgrad takes row-major and wgrad transposed, and the weight with its column-major copy for
dgrad (4 bytes an element of bf16 x with the amax, against 3 + 3 for two casts).

Bytes per element of a 16-bit x: a delayed-scaling cast (scale known in advance) reads x once
and writes one byte, 3 bytes, amax included; tensorwise scaling needs the amax before the scale,
so it is the amax pass (2 bytes) then the cast (3), 5 bytes. The torch ops it replaces move 33.

The same numbers as the torch path (fp8_cast.fp8_cast_reference) bit for bit: x widened to fp32,
multiplied by the fp32 scale (one rounding), clamped (NaN kept), rounded to nearest even; the
amax is exact (a max), NaN when x holds one (torch.amax propagates it; a per-program flag here,
because the compiled maximum drops NaN; the tiled kernel maxes |x|'s bits as int32, where every
NaN lies above +inf).
"""

import torch
import triton
import triton.language as tl

from megalite.kernels.triton_common import (cached_sm_count, cdiv, direct, eager_path, kernel_op, op_wrap_triton,
                                            persistent_programs, reduce_max, sm_count, to_dtype)

BLOCK = 2048  # elements a program handles per loop step: 16 a thread at 4 warps (16-byte loads of bf16)
NUM_WARPS = 4
TILE = 64  # the transposed cast's [TILE rows, TILE columns] tiles, at 8 warps (60 registers a thread
T_NUM_WARPS = 8  # with the amax, under 64 at sm_90: 32 warps an SM; 96 at 4 warps)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


@triton.jit
def _fp8_cast_kernel(X, SCALE, Y, AMAX, n, blocks_per_program, limit, CAST: tl.constexpr,
                     RECORD_AMAX: tl.constexpr, BLOCK: tl.constexpr):
    """Blocks pid * blocks_per_program ... of BLOCK elements: with CAST, Y = fp8(clamp(X * scale));
    with RECORD_AMAX, *AMAX = max(*AMAX, max |X|) (one atomic per program)."""
    pid = tl.program_id(0).to(tl.int64)
    if CAST:
        scale = tl.load(SCALE)
    running = tl.zeros([BLOCK], dtype=tl.float32)
    nan_seen = tl.zeros([BLOCK], dtype=tl.int32)
    for i in range(blocks_per_program):
        offs = (pid * blocks_per_program + i) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < n
        x = tl.load(X + offs, mask=ok, other=0.0).to(tl.float32)
        if CAST:
            y = x * scale
            y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -limit), limit))
            tl.store(Y + offs, to_dtype(y, Y.dtype.element_ty), mask=ok)
        if RECORD_AMAX:
            running = tl.maximum(running, tl.abs(x))
            nan_seen = nan_seen | (x != x).to(tl.int32)
    if RECORD_AMAX:
        amax = reduce_max(running, 0)
        amax = tl.where(reduce_max(nan_seen, 0) > 0, float("nan"), amax)
        tl.atomic_max(AMAX, amax)


@triton.jit
def _fp8_cast_t_kernel(X, SCALE, YT, Y, AMAX, n_rows, n_cols, stride_x, row_blocks_per_program, limit,
                       RECORD_AMAX: tl.constexpr, STORE_ROWS: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    """YT [n_cols, n_rows] = fp8(clamp(X * scale))^T for X [n_rows, n_cols] (row stride stride_x,
    unit column stride), and with STORE_ROWS the same bytes untransposed into Y [n_rows, n_cols]
    (contiguous): column block program_id(1), row blocks program_id(0) *
    row_blocks_per_program ...; RECORD_AMAX as in _fp8_cast_kernel."""
    scale = tl.load(SCALE)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    # the amax state reduced every tile (a [BLOCK_M, BLOCK_N] one kept over the loop took 186
    # registers a thread at 4 warps, one per column 160), as the bits of |x|: for non-negative
    # floats the int32 order is the float order, and every NaN lies above +inf, so one max
    # gives both the amax and whether a NaN was seen (two reductions took 70 registers with
    # STORE_ROWS, over the 64 of 32 warps an SM)
    running = 0
    for i in range(row_blocks_per_program):
        rows = (tl.program_id(0).to(tl.int64) * row_blocks_per_program + i) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = (rows < n_rows)[:, None] & col_ok[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        y = x * scale
        y = tl.where(y != y, y, tl.minimum(tl.maximum(y, -limit), limit))
        q = to_dtype(y, YT.dtype.element_ty)
        if STORE_ROWS:
            tl.store(Y + rows[:, None] * n_cols + cols[None, :], q, mask=mask)
        # stored as the transposed tile, so that the compiled layout writes along YT's rows
        tl.store(YT + cols[:, None].to(tl.int64) * n_rows + rows[None, :], tl.trans(q), mask=tl.trans(mask))
        if RECORD_AMAX:
            abs_bits = x.to(tl.int32, bitcast=True) & 0x7FFFFFFF
            running = tl.maximum(running, reduce_max(reduce_max(abs_bits, 1), 0))
    if RECORD_AMAX:
        tl.atomic_max(AMAX, tl.where(running > 0x7F800000, float("nan"), running.to(tl.float32, bitcast=True)))


def _launch_transposed(x2d, scale, yt, y, amax, record_amax: bool, sms, wrap_triton) -> None:
    """The tiled cast into yt (transposed) and, when `y` is given, y (row-major) too."""
    n_rows, n_cols = x2d.shape
    row_blocks, col_blocks = cdiv(n_rows, TILE), cdiv(n_cols, TILE)
    groups = max(1, persistent_programs(row_blocks * col_blocks, T_NUM_WARPS, sms) // col_blocks)
    per_program = cdiv(row_blocks, groups)
    wrap_triton(_fp8_cast_t_kernel)[(cdiv(row_blocks, per_program), col_blocks)](
        x2d, scale, yt, yt if y is None else y, amax, n_rows, n_cols, x2d.stride(0), per_program, FP8_MAX[yt.dtype],
        RECORD_AMAX=record_amax, STORE_ROWS=y is not None, BLOCK_M=TILE, BLOCK_N=TILE, num_warps=T_NUM_WARPS)


def _launch(x, scale, y, amax, cast: bool, record_amax: bool, sms, wrap_triton) -> None:
    n = x.numel()
    blocks = cdiv(n, BLOCK)
    programs = persistent_programs(blocks, NUM_WARPS, sms)
    per_program = cdiv(blocks, programs)
    wrap_triton(_fp8_cast_kernel)[(cdiv(blocks, per_program),)](
        x, scale, y, amax, n, per_program, FP8_MAX.get(y.dtype, 0.0), CAST=cast, RECORD_AMAX=record_amax,
        BLOCK=BLOCK, num_warps=NUM_WARPS)


def _cast_fake(x, scale, amax, out_dtype, record_amax):
    return torch.empty(x.shape, dtype=out_dtype, device=x.device)


@kernel_op("fp8_cast", _cast_fake, mutates_args=("amax",))
def fp8_cast_op(x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, out_dtype: torch.dtype,
                record_amax: bool) -> torch.Tensor:
    """fp8(clamp(x * scale)) in `out_dtype` (x contiguous, scale fp32 [1] or []); with
    record_amax, amax (fp32, one element) = max(amax, max |x|) in the same pass."""
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _launch(x, scale, y, amax, True, record_amax, sm_count(x.device), op_wrap_triton)
    return y


def _cast_t_fake(x2d, scale, amax, out_dtype, record_amax):
    return torch.empty((x2d.shape[1], x2d.shape[0]), dtype=out_dtype, device=x2d.device)


@kernel_op("fp8_cast_transposed", _cast_t_fake, mutates_args=("amax",))
def fp8_cast_transposed_op(x2d: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, out_dtype: torch.dtype,
                           record_amax: bool) -> torch.Tensor:
    """fp8(clamp(x2d * scale))^T, contiguous [cols, rows] (x2d [rows, cols] with unit column
    stride): the column-major FP8 copy _scaled_mm takes; record_amax as fp8_cast_op."""
    yt = torch.empty((x2d.shape[1], x2d.shape[0]), dtype=out_dtype, device=x2d.device)
    _launch_transposed(x2d, scale, yt, None, amax, record_amax, sm_count(x2d.device), op_wrap_triton)
    return yt


def _empty_both(x2d, scale, amax, out_dtype, record_amax):
    """The outputs of fp8_cast_transpose_op: x2d's shape, then its transpose (also its fake)."""
    return (torch.empty(x2d.shape, dtype=out_dtype, device=x2d.device),
            torch.empty((x2d.shape[1], x2d.shape[0]), dtype=out_dtype, device=x2d.device))


@kernel_op("fp8_cast_transpose", _empty_both, mutates_args=("amax",))
def fp8_cast_transpose_op(x2d: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor, out_dtype: torch.dtype,
                          record_amax: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8(clamp(x2d * scale)) [rows, cols], the same transposed [cols, rows]), both contiguous,
    from one read of x2d; record_amax as fp8_cast_op."""
    y, yt = _empty_both(x2d, scale, amax, out_dtype, record_amax)
    _launch_transposed(x2d, scale, yt, y, amax, record_amax, sm_count(x2d.device), op_wrap_triton)
    return y, yt


def _amax_fake(x):
    return x.new_empty((), dtype=torch.float32)


@kernel_op("fp8_amax", _amax_fake)
def fp8_amax_op(x: torch.Tensor) -> torch.Tensor:
    """max |x| as a 0-d fp32 tensor (x contiguous)."""
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    _launch(x, amax, x, amax, False, True, sm_count(x.device), op_wrap_triton)
    return amax


def fp8_cast(x: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype, amax: torch.Tensor | None) -> torch.Tensor:
    """The eager path (direct launch) where triton_common.eager_path allows, else the operator."""
    if eager_path(x, scale, amax) is None:
        if amax is None:
            return fp8_cast_op(x, scale, scale.new_zeros(()), out_dtype, False)
        return fp8_cast_op(x, scale, amax, out_dtype, True)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    _launch(x, scale, y, scale if amax is None else amax, True, amax is not None, cached_sm_count(x.device), direct)
    return y


def fp8_amax(x: torch.Tensor) -> torch.Tensor:
    if eager_path(x) is None:
        return fp8_amax_op(x)
    amax = torch.zeros((), dtype=torch.float32, device=x.device)
    _launch(x, amax, x, amax, False, True, cached_sm_count(x.device), direct)
    return amax


def _tiled_cast(op, x2d, scale, out_dtype, amax, store_rows: bool):
    """The tiled cast's eager path (direct launch) where triton_common.eager_path allows, else
    `op`: the transposed copy, and with `store_rows` (the row-major copy, the transposed one)."""
    if eager_path(x2d, scale, amax) is None:
        return op(x2d, scale, scale.new_zeros(()) if amax is None else amax, out_dtype, amax is not None)
    y = torch.empty(x2d.shape, dtype=out_dtype, device=x2d.device) if store_rows else None
    yt = torch.empty((x2d.shape[1], x2d.shape[0]), dtype=out_dtype, device=x2d.device)
    _launch_transposed(x2d, scale, yt, y, scale if amax is None else amax, amax is not None,
                       cached_sm_count(x2d.device), direct)
    return (y, yt) if store_rows else yt


def fp8_cast_transposed(x2d: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                        amax: torch.Tensor | None) -> torch.Tensor:
    return _tiled_cast(fp8_cast_transposed_op, x2d, scale, out_dtype, amax, store_rows=False)


def fp8_cast_transpose(x2d: torch.Tensor, scale: torch.Tensor, out_dtype: torch.dtype,
                       amax: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    return _tiled_cast(fp8_cast_transpose_op, x2d, scale, out_dtype, amax, store_rows=True)
