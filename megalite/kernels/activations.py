"""Fused SwiGLU and bias-GeLU: Triton kernels (custom operators with registered autograd,
activations_triton.py), torch references beside.

Both compute in fp32 and round once to x.dtype (reference.py).
"""

import torch

from megalite.kernels.dispatch import check_triton_device, use_triton
from megalite.kernels.reference import bias_gelu_reference, swiglu_reference

GELU_APPROXIMATIONS = ("none", "tanh")


def swiglu(x: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """SwiGLU of x [..., 2f] laid out [gate | up] along the last dim: silu(gate) * up, [..., f] in
    x.dtype (fp32 math, one rounding). impl: "auto" | "triton" | "torch"."""
    if x.dim() < 1 or x.shape[-1] % 2 != 0:
        raise ValueError(f"swiglu: x must be [..., 2f] with an even last dim, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"swiglu: x must be floating point, got {x.dtype}")
    if x.numel() > 0 and use_triton("swiglu", impl, x):
        check_triton_device("swiglu", x)
        from megalite.kernels import activations_triton

        return activations_triton.swiglu(x)
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
        from megalite.kernels import activations_triton

        return activations_triton.bias_gelu(x, bias, approximate == "tanh")
    return bias_gelu_reference(x, bias, approximate)
