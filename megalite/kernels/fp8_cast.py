"""FP8 casts of the FP8 linears (megalite/parallel/tensor/fp8_gemm.py): fp8(clamp(x * scale)),
with the amax of |x| recorded in the same pass (delayed scaling) or computed first (tensorwise
scaling), as one Triton kernel on CUDA (fp8_cast_triton.py) or the torch ops (the reference,
the CPU path).

    fp8_cast(x, scale, dtype, amax=None)   fp8(clamp(x * scale, +-fp8_max)); amax (fp32, one
                                           element) := max(amax, max |x|) when given
    fp8_cast_transposed(x2d, scale, dtype, amax=None)
                                           the same, written transposed ([cols, rows], contiguous)
    fp8_cast_transpose(x2d, scale, dtype, amax=None)
                                           both copies (row-major, transposed) from one read of x2d
    fp8_amax(x)                            max |x|, 0-d fp32
"""

import torch

from megalite.kernels.dispatch import check_triton_device, use_triton

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}


def _check(x: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    if not x.is_floating_point():
        raise ValueError(f"fp8_cast: x must be a floating-point tensor, got {x.dtype}")
    if dtype is not None and dtype not in FP8_MAX:
        raise ValueError(f"fp8_cast: dtype must be one of {sorted(map(str, FP8_MAX))}, got {dtype}")


def fused_cast_applies(x: torch.Tensor, impl: str) -> bool:
    """Whether the casts of `x` run the Triton kernel for `impl` (a contiguous, non-empty tensor
    where dispatch picks Triton: CUDA for "auto")."""
    if x.numel() == 0 or not x.is_contiguous() or not use_triton("fp8_cast", impl, x):
        return False
    check_triton_device("fp8_cast", x)
    return True


def _kernel_casts(x: torch.Tensor, scale: torch.Tensor, amax: torch.Tensor | None, impl: str) -> bool:
    """Whether a cast of `x` runs the kernel: it applies, and the scale and amax are on x's device."""
    return fused_cast_applies(x, impl) and (amax is None or amax.device == x.device) and scale.device == x.device


def _check_2d(name: str, x2d: torch.Tensor, dtype: torch.dtype) -> None:
    _check(x2d, dtype)
    if x2d.dim() != 2:
        raise ValueError(f"{name}: x must be 2-D [rows, cols], got {tuple(x2d.shape)}")


def fp8_cast_reference(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                       amax: torch.Tensor | None = None) -> torch.Tensor:
    if amax is not None:
        amax.copy_(torch.maximum(amax, x.detach().abs().amax().float().to(amax.device)))
    limit = FP8_MAX[dtype]
    return (x.float() * scale).clamp_(-limit, limit).to(dtype)


def fp8_amax_reference(x: torch.Tensor) -> torch.Tensor:
    return x.detach().abs().amax().float()


def fp8_cast(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *, amax: torch.Tensor | None = None,
             impl: str = "auto") -> torch.Tensor:
    """fp8(clamp(x * scale, -fp8_max, fp8_max)) in `dtype` (float8_e4m3fn or float8_e5m2), scale
    a one-element fp32 tensor; with `amax` (one-element fp32, on x's device for the kernel), also
    amax := max(amax, max |x|) from the same read of x."""
    _check(x, dtype)
    if _kernel_casts(x, scale, amax, impl):
        from megalite.kernels import fp8_cast_triton

        return fp8_cast_triton.fp8_cast(x, scale, dtype, amax)
    return fp8_cast_reference(x, scale, dtype, amax)


def fp8_cast_transposed(x2d: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *,
                        amax: torch.Tensor | None = None, impl: str = "auto") -> torch.Tensor:
    """fp8_cast(x2d, ...) transposed: [cols, rows], contiguous (x2d [rows, cols])."""
    _check_2d("fp8_cast_transposed", x2d, dtype)
    if _kernel_casts(x2d, scale, amax, impl):
        from megalite.kernels import fp8_cast_triton

        return fp8_cast_triton.fp8_cast_transposed(x2d, scale, dtype, amax)
    return fp8_cast_reference(x2d, scale, dtype, amax).t().contiguous()


def fp8_cast_transpose(x2d: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype, *,
                       amax: torch.Tensor | None = None, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8_cast(x2d, ...), the same bytes transposed [cols, rows]), both contiguous: on the
    kernel one pass reads x2d once and writes both (Transformer Engine's cast_transpose)."""
    _check_2d("fp8_cast_transpose", x2d, dtype)
    if _kernel_casts(x2d, scale, amax, impl):
        from megalite.kernels import fp8_cast_triton

        return fp8_cast_triton.fp8_cast_transpose(x2d, scale, dtype, amax)
    y = fp8_cast_reference(x2d, scale, dtype, amax)
    return y, y.t().contiguous()


def fp8_amax(x: torch.Tensor, *, impl: str = "auto") -> torch.Tensor:
    """max |x| as a 0-d fp32 tensor (NaN when x holds one)."""
    _check(x)
    if fused_cast_applies(x, impl):
        from megalite.kernels import fp8_cast_triton

        return fp8_cast_triton.fp8_amax(x)
    return fp8_amax_reference(x)
