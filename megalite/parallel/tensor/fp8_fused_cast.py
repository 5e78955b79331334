"""The FP8 linears' casts through megalite.kernels' fused FP8 cast (one Triton kernel on CUDA,
megalite/kernels/fp8_cast_triton.py) where it applies, with the numbers of the torch path
(fp8_scaling.quantize with the scaling's scale, and the amax it records) bit for bit:

- delayed scaling: the scale is this linear's current one, so one pass reads the tensor once,
  writes its FP8 copy and, when recording, maxes its amax straight into the amax history's
  current row (what DelayedScaling.scale does with torch ops);
- tensorwise scaling: the amax pass (then its MAX all-reduce over TP for a split operand), the
  scale from it (TensorwiseScaling.scale_for_amax), then the cast pass.

`layout` "transposed" writes the copy transposed (wgrad's column-major operands), "both" writes
the row-major copy and the transposed one from the same pass (the output gradient dgrad and wgrad
both take, the weight and its column-major copy for dgrad).

Other scalings (and CPU tensors, non-contiguous tensors, or impl "torch") take the torch path:
fused_quantize returns None.
"""

import torch

from megalite.kernels.fp8_cast import fp8_amax, fp8_cast, fp8_cast_transpose, fp8_cast_transposed, fused_cast_applies
from megalite.parallel.tensor.fp8_scaling import DelayedScaling, TensorwiseScaling


CASTS = {"rows": fp8_cast, "transposed": fp8_cast_transposed, "both": fp8_cast_transpose}


def fused_quantize(scaling, operand: int, tensor: torch.Tensor, split: bool, record: bool, dtype: torch.dtype,
                   impl: str, layout: str = "rows") -> tuple | None:
    """(fp8 copy of `tensor`, its scale) by the fused cast, or None where it does not apply; the
    copy is (row-major, transposed) for `layout` "both" (module docstring)."""
    cast = CASTS[layout]
    kind = type(scaling)
    if kind not in (DelayedScaling, TensorwiseScaling) or not fused_cast_applies(tensor, impl):
        return None
    if kind is DelayedScaling:
        if scaling.scales.device != tensor.device:
            return None
        amax = scaling.amax_history[0, operand] if record else None
        scale = scaling.scales[operand]
        return cast(tensor, scale, dtype, amax=amax, impl=impl), scale
    scale = scaling.scale_for_amax(operand, fp8_amax(tensor, impl=impl), split)
    return cast(tensor, scale, dtype, impl=impl), scale
