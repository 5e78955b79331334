"""Rotary position embedding (rotate-half convention): Triton kernel (a custom operator with
registered autograd, rotary_triton.py), torch reference.

x [s, b, n, d]; cos, sin [s, B, d_rot] in fp32 with B = 1 (positions shared by the batch) or
B = b (per-sample positions), holding cat(freqs, freqs). The first d_rot channels become
x*cos + rotate_half(x)*sin computed in fp32 and rounded once to x.dtype; channels d_rot..d pass
through. cos and sin are constants: they get no gradient.
"""

import torch

from megalite.kernels.dispatch import check_triton_device, use_triton
from megalite.kernels.reference import apply_rotary_reference


def _check(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    if x.dim() != 4 or not x.is_floating_point():
        raise ValueError(f"apply_rotary: x must be a floating-point [s, b, n, d] tensor, got {x.dtype} {tuple(x.shape)}")
    s, b, _, d = x.shape
    if cos.shape != sin.shape:
        raise ValueError(f"apply_rotary: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have the same shape")
    if cos.dim() != 3 or cos.shape[0] != s or cos.shape[1] not in (1, b):
        raise ValueError(f"apply_rotary: cos/sin must be [s={s}, 1 or b={b}, d_rot], got {tuple(cos.shape)}")
    d_rot = cos.shape[-1]
    if d_rot % 2 != 0 or not 0 < d_rot <= d:
        raise ValueError(f"apply_rotary: rotary dim (cos.shape[-1] = {d_rot}) must be even and in (0, head dim {d}]")


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [s, b, n, d] by cos/sin [s, 1 or b, d_rot] (fp32,
    rotate-half layout); the rest pass through. Returns a new tensor in x.dtype.
    impl: "auto" | "triton" | "torch" (see megalite.kernels.dispatch)."""
    _check(x, cos, sin)
    if x.numel() > 0 and use_triton("apply_rotary", impl, x, cos, sin):
        check_triton_device("apply_rotary", x, cos, sin)
        cos, sin = cos.float().contiguous(), sin.float().contiguous()
        from megalite.kernels import rotary_triton

        return rotary_triton.apply_rotary(x if x.stride(-1) == 1 else x.contiguous(), cos, sin)
    return apply_rotary_reference(x, cos, sin)
