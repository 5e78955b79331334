"""Fused SwiGLU and bias-GeLU: Triton kernels with autograd, torch references beside.

Both compute in fp32 and round once to x.dtype (reference.py). The backward recomputes the
activation from the saved input instead of saving the output.
"""

import torch

from megalite.kernels.dispatch import as_rows, check_triton_device, use_triton
from megalite.kernels.reference import bias_gelu_reference, swiglu_reference

GELU_APPROXIMATIONS = ("none", "tanh")


class _SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        from megalite.kernels import activations_triton

        ctx.save_for_backward(x)
        return activations_triton.swiglu_forward(as_rows(x)).view(*x.shape[:-1], x.shape[-1] // 2)

    @staticmethod
    def backward(ctx, dy):
        from megalite.kernels import activations_triton

        (x,) = ctx.saved_tensors
        return activations_triton.swiglu_backward(as_rows(dy), as_rows(x)).view(x.shape)


class _BiasGeLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, bias, approximate_tanh):
        from megalite.kernels import activations_triton

        ctx.save_for_backward(x, bias)
        ctx.approximate_tanh = approximate_tanh
        return activations_triton.bias_gelu_forward(as_rows(x), bias, approximate_tanh).view(x.shape)

    @staticmethod
    def backward(ctx, dy):
        from megalite.kernels import activations_triton

        x, bias = ctx.saved_tensors
        dx, dbias = activations_triton.bias_gelu_backward(as_rows(dy), as_rows(x), bias, ctx.approximate_tanh)
        dbias = dbias.to(bias.dtype) if bias is not None and ctx.needs_input_grad[1] else None
        return dx.view(x.shape), dbias, None


def swiglu(x: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """SwiGLU of x [..., 2f] laid out [gate | up] along the last dim: silu(gate) * up, [..., f] in
    x.dtype (fp32 math, one rounding). impl: "auto" | "triton" | "torch"."""
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"swiglu: x must be [..., 2f] with an even last dim, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"swiglu: x must be floating point, got {x.dtype}")
    if x.numel() > 0 and use_triton("swiglu", impl, x):
        check_triton_device("swiglu", x)
        return _SwiGLUFunction.apply(x)
    return swiglu_reference(x)


def bias_gelu(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none", *,
              impl: str = "auto") -> torch.Tensor:
    """gelu(x + bias) for x [..., f] and bias [f] or None; approximate 'none' (erf) or 'tanh'.
    fp32 math, one rounding to x.dtype. impl: "auto" | "triton" | "torch"."""
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"bias_gelu: approximate must be one of {GELU_APPROXIMATIONS}, got {approximate!r}")
    if x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"bias_gelu: x must be a floating-point [..., f] tensor, got {x.dtype} {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"bias_gelu: bias must have shape ({x.shape[-1]},) to match x {tuple(x.shape)}, "
                         f"got {tuple(bias.shape)}")
    if x.numel() > 0 and use_triton("bias_gelu", impl, x, bias):
        check_triton_device("bias_gelu", x, bias)
        return _BiasGeLUFunction.apply(x, bias, approximate == "tanh")
    return bias_gelu_reference(x, bias, approximate)
