"""Bias-dropout-add, residual + dropout(x + bias, p), after attention and after the MLP (Megatron's
bias-dropout-add fusion): a Triton kernel (a custom operator with registered autograd,
bias_dropout_add_triton.py), the torch reference beside.

With p = 0 both compute residual + (x + bias) with the same roundings (bit-equal). With p > 0
the Triton kernel draws its own mask (Philox, from a seed drawn from torch's generator of x's
device, so the RNG state, its forks and checkpoint restores decide it), not the mask F.dropout
would draw from the same state: torch's CUDA dropout lays its Philox streams out by its own
launch geometry and the CPU's draws from another generator, so neither can be reproduced by a
kernel of another shape. Its mask has the same distribution (independent keeps of probability
1 - p, scaled by 1 / (1 - p)); the backward regenerates exactly the forward's.
"""

import torch

from megalite.kernels.dispatch import check_triton_device, use_triton
from megalite.kernels.reference import bias_dropout_add_reference

SEED_BOUND = 2 ** 62  # seeds are drawn in [0, SEED_BOUND)


def _check(x, bias, residual, p) -> None:
    if x.dim() < 1 or not x.is_floating_point():
        raise ValueError(f"bias_dropout_add: x must be a floating-point [..., h] tensor, got {x.dtype} {tuple(x.shape)}")
    if residual.shape != x.shape:
        raise ValueError(f"bias_dropout_add: residual {tuple(residual.shape)} must have x's shape {tuple(x.shape)}")
    if bias is not None and tuple(bias.shape) != (x.shape[-1],):
        raise ValueError(f"bias_dropout_add: bias must have shape ({x.shape[-1]},) to match x {tuple(x.shape)}, "
                         f"got {tuple(bias.shape)}")
    if not 0.0 <= p < 1.0:
        raise ValueError(f"bias_dropout_add: dropout probability must be in [0, 1), got {p}")


def _triton_ok(impl, x, bias, residual) -> bool:
    if x.numel() == 0 or not use_triton("bias_dropout_add", impl, x, bias, residual):
        return False
    mixed = residual.dtype != x.dtype or (bias is not None and bias.dtype != x.dtype)
    if mixed:  # the reference promotes; the kernel writes x's dtype
        if impl == "triton":
            raise ValueError(f"bias_dropout_add: impl='triton' needs x, bias and residual of one dtype, got x "
                             f"{x.dtype}, bias {None if bias is None else bias.dtype}, residual {residual.dtype}")
        return False
    check_triton_device("bias_dropout_add", x, bias, residual)
    return True


def bias_dropout_add(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor, p: float, *,
                     impl: str = "auto") -> torch.Tensor:
    """residual + dropout(x + bias, p) for x and residual [..., h] and bias [h] or None; p = 0 for no
    dropout (evaluation). impl: "auto" | "triton" | "torch" (see megalite.kernels.dispatch)."""
    _check(x, bias, residual, p)
    if bias is None and p == 0:
        return residual + x  # one torch kernel already
    if _triton_ok(impl, x, bias, residual):
        from megalite.kernels import bias_dropout_add_triton

        seed = torch.randint(0, SEED_BOUND, (1,), device=x.device) if p > 0 else None
        return bias_dropout_add_triton.bias_dropout_add(x, bias, residual, seed, float(p))
    return bias_dropout_add_reference(x, bias, residual, p)
