"""Triton SwiGLU and bias-GeLU: elementwise tile kernels, fp32 math, one rounding on store,
registered as the operators megalite_kernels::swiglu_forward / ::bias_gelu_forward, each
differentiable through its backward operator (which recomputes the activation from the saved
input instead of saving the output), and launched directly by SwigluFunction / BiasGeluFunction
on the eager path.

Bias-GeLU's backward also reduces dbias: each program writes its tile's fp32 column sums (one
row per row block, at most 1/8 of dx's bytes) and a second small kernel
(triton_common.launch_column_sums) sums them over row blocks into dbias.
"""

import functools

import torch
import triton
import triton.language as tl

from megalite.kernels.dispatch import as_rows, rows_of
from megalite.kernels.triton_common import (apply, cached_column_sums_launch, cdiv, direct, eager_path, kernel_op,
                                            launch_column_sums, op_wrap_triton, reduce_sum, rows_per_program, sigmoid,
                                            to_dtype, warps_for)


@triton.jit
def _swiglu_fwd_kernel(X, Y, n_rows, f, stride_x, stride_y, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < f)[None, :]
    gate_ptr = X + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + f, mask=mask, other=0.0).to(tl.float32)
    y = gate * sigmoid(gate) * up
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], to_dtype(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(X, DY, DX, n_rows, f, stride_x, stride_dy, stride_dx,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows < n_rows)[:, None] & (cols < f)[None, :]
    gate_ptr = X + rows[:, None] * stride_x + cols[None, :]
    gate = tl.load(gate_ptr, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gate_ptr + f, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    sig = sigmoid(gate)
    silu = gate * sig
    dgate = dy * up * sig * (1.0 + gate * (1.0 - sig))
    dx_ptr = DX + rows[:, None] * stride_dx + cols[None, :]
    tl.store(dx_ptr, to_dtype(dgate, DX.dtype.element_ty), mask=mask)
    tl.store(dx_ptr + f, to_dtype(dy * silu, DX.dtype.element_ty), mask=mask)


@triton.jit
def _gelu_and_grad(u, APPROX_TANH: tl.constexpr):
    """gelu(u) and gelu'(u) in fp32. The tanh form uses 0.5*(1 + tanh(z)) = sigmoid(2z), which
    does not cancel for large negative u. Constants: sqrt(2/pi) = 0.7978845608028654,
    1/sqrt(2) = 0.7071067811865476, 1/sqrt(2*pi) = 0.3989422804014327."""
    if APPROX_TANH:
        dz = 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * u * u)
        s = sigmoid(2.0 * 0.7978845608028654 * (u + 0.044715 * u * u * u))
        return u * s, s + 2.0 * u * s * (1.0 - s) * dz
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(u * 0.7071067811865476))
        return u * cdf, cdf + u * 0.3989422804014327 * tl.exp(-0.5 * u * u)


@triton.jit
def _bias_gelu_fwd_kernel(X, B, Y, n_rows, f, stride_x, stride_y, HAS_BIAS: tl.constexpr,
                          APPROX_TANH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < f
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    u = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        u += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    y, _ = _gelu_and_grad(u, APPROX_TANH)
    tl.store(Y + rows[:, None] * stride_y + cols[None, :], to_dtype(y, Y.dtype.element_ty), mask=mask)


@triton.jit
def _bias_gelu_bwd_kernel(X, B, DY, DX, DB_PART, n_rows, f, stride_x, stride_dy, stride_dx,
                          HAS_BIAS: tl.constexpr, APPROX_TANH: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """One tile per program, as the forward: dx, and with a bias the tile's fp32 column sums as
    row pid_m of DB_PART (one reduction per program, after its only loads and stores)."""
    pid_m = tl.program_id(0)
    rows = pid_m.to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < f
    mask = (rows < n_rows)[:, None] & col_ok[None, :]
    u = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        u += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    _, grad = _gelu_and_grad(u, APPROX_TANH)
    du = tl.where(mask, dy * grad, 0.0)
    tl.store(DX + rows[:, None] * stride_dx + cols[None, :], to_dtype(du, DX.dtype.element_ty), mask=mask)
    if HAS_BIAS:
        tl.store(DB_PART + pid_m * f + cols, reduce_sum(du, axis=0), mask=col_ok)


def _tiles(n_rows: int, n_cols: int, elems_per_thread: int = 16) -> tuple[int, int, int]:
    block_n = min(triton.next_power_of_2(n_cols), 1024)
    block_m = rows_per_program(block_n, n_rows)
    return block_m, block_n, warps_for(block_m * block_n, elems_per_thread)


_cached_tiles = functools.lru_cache(maxsize=256)(_tiles)

# The backward's tile with a bias: 2048 elements at 8 a thread (8 warps); the erf form compiles to
# 32 registers for sm_90, so 8 programs share an SM. At most 128 columns wide, so that a tile spans
# 16+ rows and the dbias partials (one fp32 row per row block) cost <= 1/8 of dx's bytes.
BWD_TILE_ELEMS, BWD_MAX_COLS = 2048, 128


def bias_gelu_backward_launch(n_rows: int, f: int, has_bias: bool):
    """(row blocks, column blocks, BLOCK_M, BLOCK_N, num_warps) of the backward: a grid of tiles
    like the forward's, no loop inside a program. The first H100 run measured the earlier design
    (persistent programs looping over row blocks, a cross-warp dbias sum per block) at 21% of
    copy bandwidth against the forward's 92%."""
    block_n = min(triton.next_power_of_2(f), BWD_MAX_COLS if has_bias else 1024)
    block_m = rows_per_program(block_n, n_rows, BWD_TILE_ELEMS if has_bias else 4096)
    num_warps = warps_for(block_m * block_n, 8)
    return cdiv(n_rows, block_m), cdiv(f, block_n), block_m, block_n, num_warps


_cached_bias_gelu_backward_launch = functools.lru_cache(maxsize=256)(bias_gelu_backward_launch)


def _like_rows(x2d, n_cols):
    return x2d.new_empty((x2d.shape[0], n_cols))


def _swiglu_forward(x, n_rows, stride_x, y, tiles, wrap_triton):
    """x: [..., 2f] rows `stride_x` apart; y: contiguous [..., f]."""
    f = x.shape[-1] // 2
    block_m, block_n, num_warps = tiles
    grid = (cdiv(n_rows, block_m), cdiv(f, block_n))
    wrap_triton(_swiglu_fwd_kernel)[grid](x, y, n_rows, f, stride_x, f,
                                          BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return y


def _swiglu_backward(dy, stride_dy, x, n_rows, stride_x, dx, tiles, wrap_triton):
    """dy: [..., f] rows `stride_dy` apart; dx: contiguous [..., 2f]."""
    f = dy.shape[-1]
    block_m, block_n, num_warps = tiles
    grid = (cdiv(n_rows, block_m), cdiv(f, block_n))
    wrap_triton(_swiglu_bwd_kernel)[grid](x, dy, dx, n_rows, f, stride_x, stride_dy, 2 * f,
                                          BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return dx


def _bias_gelu_forward(x, n_rows, stride_x, bias, approximate_tanh, y, tiles, wrap_triton):
    f = x.shape[-1]
    block_m, block_n, num_warps = tiles
    grid = (cdiv(n_rows, block_m), cdiv(f, block_n))
    wrap_triton(_bias_gelu_fwd_kernel)[grid](x, bias, y, n_rows, f, stride_x, f,
                                             HAS_BIAS=bias is not None, APPROX_TANH=approximate_tanh,
                                             BLOCK_M=block_m, BLOCK_N=block_n, num_warps=num_warps)
    return y


def _bias_gelu_backward(dy, stride_dy, x, n_rows, stride_x, bias, approximate_tanh, dx, dbias, launch, wrap_triton):
    """Writes dx (contiguous, x's last dim) and dbias [f] (None without a bias; fp32 on the operator
    path, the bias's dtype on the eager path), the sum of the programs' partials in a second launch."""
    f = x.shape[-1]
    row_blocks, col_blocks, block_m, block_n, num_warps = launch
    db_part = None if bias is None else x.new_empty((row_blocks, f), dtype=torch.float32)
    wrap_triton(_bias_gelu_bwd_kernel)[(row_blocks, col_blocks)](
        x, bias, dy, dx, db_part, n_rows, f, stride_x, stride_dy, f,
        HAS_BIAS=bias is not None, APPROX_TANH=approximate_tanh, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=num_warps)
    if bias is not None:
        launch_column_sums(db_part, None, dbias, None, cached_column_sums_launch(row_blocks, f), wrap_triton)


@kernel_op("swiglu_forward", lambda x2d: _like_rows(x2d, x2d.shape[1] // 2))
def swiglu_forward(x2d: torch.Tensor) -> torch.Tensor:
    """x2d [N, 2f] (unit stride along the last dim) -> silu(gate) * up [N, f]."""
    n_rows, f = x2d.shape[0], x2d.shape[1] // 2
    return _swiglu_forward(x2d, n_rows, x2d.stride(0), _like_rows(x2d, f), _tiles(n_rows, f), op_wrap_triton)


@kernel_op("swiglu_backward", lambda dy2d, x2d: _like_rows(x2d, x2d.shape[1]))
def swiglu_backward(dy2d: torch.Tensor, x2d: torch.Tensor) -> torch.Tensor:
    """dy2d [N, f], x2d [N, 2f] -> dx [N, 2f] = [dgate | dup]."""
    n_rows, f = dy2d.shape
    return _swiglu_backward(dy2d, dy2d.stride(0), x2d, n_rows, x2d.stride(0), _like_rows(x2d, 2 * f),
                            _tiles(n_rows, f), op_wrap_triton)


@kernel_op("bias_gelu_forward", lambda x2d, bias, approximate_tanh: _like_rows(x2d, x2d.shape[1]))
def bias_gelu_forward(x2d: torch.Tensor, bias: torch.Tensor | None, approximate_tanh: bool) -> torch.Tensor:
    """x2d [N, f] (unit stride along f), bias [f] or None -> gelu(x + bias) [N, f]."""
    n_rows, f = x2d.shape
    return _bias_gelu_forward(x2d, n_rows, x2d.stride(0), bias, approximate_tanh, _like_rows(x2d, f),
                              _tiles(n_rows, f), op_wrap_triton)


def _bias_gelu_backward_fake(dy2d, x2d, bias, approximate_tanh):
    return _like_rows(x2d, x2d.shape[1]), x2d.new_empty(0 if bias is None else x2d.shape[1], dtype=torch.float32)


@kernel_op("bias_gelu_backward", _bias_gelu_backward_fake)
def bias_gelu_backward(dy2d: torch.Tensor, x2d: torch.Tensor, bias: torch.Tensor | None,
                       approximate_tanh: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (dx [N, f] in x's dtype, dbias fp32 [f] (empty without a bias))."""
    n_rows, f = x2d.shape
    launch = bias_gelu_backward_launch(n_rows, f, bias is not None)
    dx = _like_rows(x2d, f)
    dbias = x2d.new_empty(0 if bias is None else f, dtype=torch.float32)
    _bias_gelu_backward(dy2d, dy2d.stride(0), x2d, n_rows, x2d.stride(0), bias, approximate_tanh, dx,
                        None if bias is None else dbias, launch, op_wrap_triton)
    return dx, dbias


def _setup_swiglu(ctx, inputs, output):
    ctx.save_for_backward(inputs[0])


def _swiglu_grad(ctx, dy2d):
    (x2d,) = ctx.saved_tensors
    return swiglu_backward(as_rows(dy2d), x2d)


swiglu_forward.register_autograd(_swiglu_grad, setup_context=_setup_swiglu)


def _setup_bias_gelu(ctx, inputs, output):
    x2d, bias, ctx.approximate_tanh = inputs
    ctx.save_for_backward(x2d, bias)


def _bias_gelu_grad(ctx, dy2d):
    x2d, bias = ctx.saved_tensors
    dx, dbias = bias_gelu_backward(as_rows(dy2d), x2d, bias, ctx.approximate_tanh)
    dbias = dbias.to(bias.dtype) if bias is not None and ctx.needs_input_grad[1] else None
    return dx, dbias, None


bias_gelu_forward.register_autograd(_bias_gelu_grad, setup_context=_setup_bias_gelu)


def _eager_swiglu(x):
    rows, n_rows, stride_x = rows_of(x)
    f = x.shape[-1] // 2
    y = x.new_empty((*x.shape[:-1], f))
    return _swiglu_forward(rows, n_rows, stride_x, y, _cached_tiles(n_rows, f), direct), rows, n_rows, stride_x


def _eager_bias_gelu(x, bias, approximate_tanh):
    rows, n_rows, stride_x = rows_of(x)
    y = torch.empty_like(x) if rows is x else x.new_empty(x.shape)
    y = _bias_gelu_forward(rows, n_rows, stride_x, bias, approximate_tanh, y, _cached_tiles(n_rows, x.shape[-1]),
                           direct)
    return y, rows, n_rows, stride_x


def _grad_like(saved, shape):
    """A contiguous tensor of `shape` for the gradient of the input saved as `saved`."""
    return torch.empty_like(saved) if saved.shape == shape else saved.new_empty(shape)


class SwigluFunction(torch.autograd.Function):
    """The eager path of swiglu_forward / swiglu_backward (triton_common.eager_path says when)."""

    @staticmethod
    def forward(ctx, x):
        y, rows, n_rows, stride_x = _eager_swiglu(x)
        ctx.save_for_backward(rows)
        ctx.meta = (n_rows, stride_x, x.shape)
        return y

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        n_rows, stride_x, shape = ctx.meta
        dy, _, stride_dy = rows_of(dy)
        return _swiglu_backward(dy, stride_dy, x, n_rows, stride_x, _grad_like(x, shape),
                                _cached_tiles(n_rows, dy.shape[-1]), direct)


class BiasGeluFunction(torch.autograd.Function):
    """The eager path of bias_gelu_forward / bias_gelu_backward (triton_common.eager_path says when)."""

    @staticmethod
    def forward(ctx, x, bias, approximate_tanh):
        y, rows, n_rows, stride_x = _eager_bias_gelu(x, bias, approximate_tanh)
        ctx.save_for_backward(rows, bias)
        ctx.meta = (approximate_tanh, n_rows, stride_x, x.shape)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, bias = ctx.saved_tensors
        approximate_tanh, n_rows, stride_x, shape = ctx.meta
        dy, _, stride_dy = rows_of(dy)
        launch = _cached_bias_gelu_backward_launch(n_rows, x.shape[-1], bias is not None)
        dx = _grad_like(x, shape)
        dbias = None if bias is None else bias.new_empty(x.shape[-1])
        _bias_gelu_backward(dy, stride_dy, x, n_rows, stride_x, bias, approximate_tanh, dx, dbias, launch, direct)
        return dx, dbias if ctx.needs_input_grad[1] else None, None


_apply_swiglu = super(torch.autograd.Function, SwigluFunction).apply
_apply_bias_gelu = super(torch.autograd.Function, BiasGeluFunction).apply


def swiglu(x: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up [..., f] of x [..., 2f]: the eager path where triton_common.eager_path allows,
    else the operator."""
    grad = eager_path(x)
    if grad is None:
        return swiglu_forward(as_rows(x)).view(*x.shape[:-1], x.shape[-1] // 2)
    return apply(SwigluFunction, _apply_swiglu, x) if grad else _eager_swiglu(x)[0]


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate_tanh: bool) -> torch.Tensor:
    """gelu(x + bias) [..., f]: the eager path where triton_common.eager_path allows, else the operator."""
    grad = eager_path(x, bias)
    if grad is None:
        return bias_gelu_forward(as_rows(x), bias, approximate_tanh).view(x.shape)
    if grad:
        return apply(BiasGeluFunction, _apply_bias_gelu, x, bias, approximate_tanh)
    return _eager_bias_gelu(x, bias, approximate_tanh)[0]
