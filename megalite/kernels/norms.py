"""RMSNorm and LayerNorm over the last dim: Triton kernels (custom operators with registered
autograd, norms_triton.py), torch references beside.

Semantics (see reference.py): LayerNorm equals F.layer_norm computed in fp32 and cast to
x.dtype; RMSNorm follows Hugging Face Llama's order, weight * (normalised x rounded to
x.dtype), cast to x.dtype. The Triton backward accumulates in fp32 and returns dweight/dbias in
the parameters' dtypes.
"""

import torch

from megalite.kernels.dispatch import check_triton_device, use_triton
from megalite.kernels.reference import layer_norm_reference, rms_norm_reference

MAX_TRITON_COLS = 16384  # wider rows would spill registers in the Triton backward; the torch path takes them


def _check(op: str, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have a hidden dim, got a 0-d tensor")
    h = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and (p.dim() != 1 or p.shape[0] != h):
            raise ValueError(f"{op}: {name} must have shape ({h},) to match x {tuple(x.shape)}, got {tuple(p.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{op}: x must be floating point, got {x.dtype}")


def _triton_ok(op: str, impl: str, x, weight, bias) -> bool:
    if not use_triton(op, impl, x, weight, bias):
        return False
    if x.shape[-1] > MAX_TRITON_COLS or x.numel() == 0:
        if impl == "triton" and x.numel() > 0:
            raise ValueError(f"{op}: impl='triton' supports hidden size <= {MAX_TRITON_COLS}, got {x.shape[-1]}")
        return False
    check_triton_device(op, x, weight, bias)
    return True


def _norm_triton(x, weight, bias, eps: float, is_rms: bool) -> torch.Tensor:
    from megalite.kernels import norms_triton

    return norms_triton.norm(x, weight, bias, eps, is_rms)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, *, impl: str = "auto") -> torch.Tensor:
    """RMSNorm of x [..., h] with weight [h]: weight * (x.float() * rsqrt(mean(x.float()^2) + eps)).to(x.dtype),
    returned in x.dtype. impl: "auto" | "triton" | "torch" (see megalite.kernels.dispatch)."""
    _check("rms_norm", x, weight, None)
    if _triton_ok("rms_norm", impl, x, weight, None):
        return _norm_triton(x, weight, None, eps, True)
    return rms_norm_reference(x, weight, eps)


def layer_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float = 1e-5, *,
               impl: str = "auto") -> torch.Tensor:
    """LayerNorm of x [..., h] with weight [h] and optional bias [h], F.layer_norm in fp32, returned in
    x.dtype. impl: "auto" | "triton" | "torch" (see megalite.kernels.dispatch)."""
    _check("layer_norm", x, weight, bias)
    if _triton_ok("layer_norm", impl, x, weight, bias):
        return _norm_triton(x, weight, bias, eps, False)
    return layer_norm_reference(x, weight, bias, eps)
