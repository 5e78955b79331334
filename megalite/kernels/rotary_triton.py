"""Triton rotary embedding (rotate-half convention), forward and backward: the operator
megalite_kernels::rotary, whose gradient is itself with `backward` flipped (the transpose), and
RotaryFunction, the same kernel launched directly on the eager path.

One program handles one token (s, b) and BLOCK_H heads: it loads the token's cos/sin once
(fp32, [d_rot], rows of B = 1 broadcast over the batch), rotates the first d_rot channels of
each head and copies the remaining channels through. With halves x1 = x[:d_rot/2] and
x2 = x[d_rot/2:d_rot]:

    forward:  o1 = x1*cos1 - x2*sin1    o2 = x2*cos2 + x1*sin2
    backward: o1 = x1*cos1 + x2*sin2    o2 = x2*cos2 - x1*sin1     (the transpose)
"""

import functools

import torch
import triton
import triton.language as tl

from megalite.kernels.triton_common import (apply, cdiv, direct, eager_path, kernel_op, op_wrap_triton, to_dtype,
                                            warps_for)


@triton.jit
def _rotary_kernel(X, COS, SIN, Y, n_batch, n_heads, half, head_dim,
                   stride_xs, stride_xb, stride_xh, stride_ys, stride_yb, stride_yh,
                   stride_cs, stride_cb,
                   BACKWARD: tl.constexpr, HAS_PASS: tl.constexpr,
                   BLOCK_H: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_P: tl.constexpr):
    token = tl.program_id(0)
    s = token // n_batch
    b = token % n_batch
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    head_ok = heads < n_heads
    r = tl.arange(0, BLOCK_R)
    r_ok = r < half
    cs_off = s.to(tl.int64) * stride_cs + b * stride_cb
    cos1 = tl.load(COS + cs_off + r, mask=r_ok, other=0.0).to(tl.float32)
    cos2 = tl.load(COS + cs_off + half + r, mask=r_ok, other=0.0).to(tl.float32)
    sin1 = tl.load(SIN + cs_off + r, mask=r_ok, other=0.0).to(tl.float32)
    sin2 = tl.load(SIN + cs_off + half + r, mask=r_ok, other=0.0).to(tl.float32)
    if BACKWARD:
        sin1, sin2 = -sin2, -sin1
    x_row = X + s.to(tl.int64) * stride_xs + b.to(tl.int64) * stride_xb + heads[:, None].to(tl.int64) * stride_xh
    y_row = Y + s.to(tl.int64) * stride_ys + b.to(tl.int64) * stride_yb + heads[:, None].to(tl.int64) * stride_yh
    mask = head_ok[:, None] & r_ok[None, :]
    x1 = tl.load(x_row + r[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x_row + half + r[None, :], mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos1[None, :] - x2 * sin1[None, :]
    o2 = x2 * cos2[None, :] + x1 * sin2[None, :]
    tl.store(y_row + r[None, :], to_dtype(o1, Y.dtype.element_ty), mask=mask)
    tl.store(y_row + half + r[None, :], to_dtype(o2, Y.dtype.element_ty), mask=mask)
    if HAS_PASS:
        p = 2 * half + tl.arange(0, BLOCK_P)
        p_mask = head_ok[:, None] & (p < head_dim)[None, :]
        tl.store(y_row + p[None, :], tl.load(x_row + p[None, :], mask=p_mask), mask=p_mask)


def _blocks(n_heads: int, head_dim: int, half: int) -> tuple[int, int, int, int]:
    """(BLOCK_H, BLOCK_R, BLOCK_P, num_warps)."""
    block_r = triton.next_power_of_2(half)
    block_p = triton.next_power_of_2(max(head_dim - 2 * half, 1))
    block_h = min(triton.next_power_of_2(n_heads), max(1, 2048 // (2 * block_r)))
    return block_h, block_r, block_p, warps_for(block_h * 2 * block_r)


_cached_blocks = functools.lru_cache(maxsize=256)(_blocks)


def _rotary(x, cos, sin, backward, blocks, wrap_triton):
    n_seq, n_batch, n_heads, head_dim = x.shape
    half = cos.shape[-1] // 2
    y = torch.empty((n_seq, n_batch, n_heads, head_dim), dtype=x.dtype, device=x.device)  # contiguous
    block_h, block_r, block_p, num_warps = blocks
    stride_xs, stride_xb, stride_xh, _ = x.stride()
    stride_cs, stride_cb, _ = cos.stride()
    grid = (n_seq * n_batch, cdiv(n_heads, block_h))
    wrap_triton(_rotary_kernel)[grid](
        x, cos, sin, y, n_batch, n_heads, half, head_dim,
        stride_xs, stride_xb, stride_xh, n_batch * n_heads * head_dim, n_heads * head_dim, head_dim,
        stride_cs, stride_cb if cos.shape[1] == n_batch and n_batch > 1 else 0,
        BACKWARD=backward, HAS_PASS=head_dim > 2 * half,
        BLOCK_H=block_h, BLOCK_R=block_r, BLOCK_P=block_p, num_warps=num_warps)
    return y


@kernel_op("rotary", lambda x, cos, sin, backward: torch.empty_like(x, memory_format=torch.contiguous_format))
def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """x [s, b, n, d] (unit stride along d); cos, sin fp32 [s, 1 or b, d_rot] with unit stride along
    d_rot and equal strides. Returns a new contiguous [s, b, n, d] tensor in x's dtype."""
    return _rotary(x, cos, sin, backward, _blocks(x.shape[2], x.shape[3], cos.shape[-1] // 2), op_wrap_triton)


def _setup_rotary(ctx, inputs, output):
    _, cos, sin, ctx.backward = inputs
    ctx.save_for_backward(cos, sin)


def _rotary_grad(ctx, dy):
    cos, sin = ctx.saved_tensors
    dy = dy if dy.stride(-1) == 1 else dy.contiguous()
    return rotary(dy, cos, sin, not ctx.backward), None, None, None


rotary.register_autograd(_rotary_grad, setup_context=_setup_rotary)


def _eager_rotary(x, cos, sin, backward):
    return _rotary(x, cos, sin, backward, _cached_blocks(x.shape[2], x.shape[3], cos.shape[-1] // 2), direct)


class RotaryFunction(torch.autograd.Function):
    """The eager path of the rotary operator (triton_common.eager_path says when)."""

    @staticmethod
    def forward(ctx, x, cos, sin):
        ctx.save_for_backward(cos, sin)
        return _eager_rotary(x, cos, sin, False)

    @staticmethod
    def backward(ctx, dy):
        cos, sin = ctx.saved_tensors
        return _eager_rotary(dy if dy.stride(-1) == 1 else dy.contiguous(), cos, sin, True), None, None


_apply_rotary = super(torch.autograd.Function, RotaryFunction).apply


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotated x: the eager path where triton_common.eager_path allows, else the operator."""
    grad = eager_path(x, cos, sin)
    if grad is None:
        return rotary(x, cos, sin, False)
    return apply(RotaryFunction, _apply_rotary, x, cos, sin) if grad else _eager_rotary(x, cos, sin, False)
