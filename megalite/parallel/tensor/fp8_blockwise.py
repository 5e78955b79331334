"""--fp8-recipe blockwise: Transformer Engine's Float8BlockScaling (what Megatron builds for it,
megatron/core/fp8_utils.py get_fp8_recipe), the DeepSeek-V3 scheme. Every tensor is quantized
in blocks, each with its own scale, fp32 and a power of 2:

    scale = fp8_max / amax(block), its mantissa bits cleared (rounded down to a power of 2);
            1 where amax is 0 or infinite, fp32's largest where fp8_max / amax overflows
    data  = fp8(clamp(tensor * scale)),  the GEMM multiplying by 1 / scale (exact: a power of 2)

Blocks are 1x128 (128 consecutive elements of a row along the GEMM's reduction dimension) for
the activations and gradients and 128x128 for the weights, the formats as --fp8-format says
(e4m3 everywhere, or hybrid: e5m2 gradients). Which tensor is tiled how in each GEMM:

    fprop  y  = x W^T   x: 1x128 along k (rows of x)           W: 128x128
    dgrad  dx = dy W    dy: 1x128 along n (rows of dy)         W: 128x128 (the same blocks)
    wgrad  dW = dy^T x  dy^T, x^T: 1x128 along the tokens (columns of dy and x)

so x and dy are quantized twice, once along each dimension, each time from the 16-bit tensor
(a 1x128 quantization cannot be transposed). A dimension that is not a multiple of 128 ends in
a partial block, whose scale comes from the elements it has (Transformer Engine's quantizer).
No scale is shared across ranks: a tensor-parallel rank quantizes its own shard, so a layout
reproduces the one-process run when each rank's split dimensions are multiples of 128.

The GEMM: torch's block-scaled scaled_mm (torch.nn.functional.scaled_mm with
ScalingType.BlockWise1x128 / BlockWise128x128: cuBLASLt's block-scaled FP8 GEMM, sm_90 only in
torch 2.13) on a Hopper GPU when the reduction dimension is a multiple of 128 (and the 128x128
operand's other one); otherwise, and on CPU, `emulated_mm`: the operands dequantized with their
block scales and multiplied in fp32, the reference the kernel is checked against.
"""

import torch
import torch.nn.functional as F

from megalite.parallel.tensor.fp8_gemm import Fp8Gemm
from megalite.parallel.tensor.fp8_scaling import FP8_MAX, GRAD, INPUT, WEIGHT, Fp8Recipe

BLOCK = 128
_EXPONENT_BITS = -8388608  # 0xFF800000 as int32: sign and exponent, mantissa cleared


def block_scales(amax: torch.Tensor, fp8_max: float) -> torch.Tensor:
    """Transformer Engine's power-of-2 scale from each block's amax (module docstring)."""
    amax = amax.float()
    scale = torch.where((amax == 0) | torch.isinf(amax), torch.ones_like(amax), fp8_max / amax)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, torch.finfo(torch.float32).max), scale)
    scale = torch.where(torch.isnan(scale), torch.ones_like(scale), scale)
    return (scale.view(torch.int32) & _EXPONENT_BITS).view(torch.float32)


def _padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`t` [m, k] with zeros appended up to [rows, cols] (zeros do not change an amax)."""
    m, k = t.shape
    return t if (m, k) == (rows, cols) else F.pad(t, (0, cols - k, 0, rows - m))


def _saturating_cast(tiles: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp8(clamp(tiles * scale)) (fp8_scaling.quantize's arithmetic) through one fp32 copy,
    scaled and clamped in place: 5 bytes per element at most, not 9."""
    limit = FP8_MAX[dtype]
    return tiles.to(torch.float32, copy=True).mul_(scale).clamp_(-limit, limit).to(dtype)


def quantize_1x128(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` [m, k] quantized per 1x128 tile along k: (fp8 data [m, k], inverse scales
    [m, ceil(k / 128)])."""
    m, k = t.shape
    blocks = -(-k // BLOCK)
    tiles = _padded(t.detach(), m, blocks * BLOCK).reshape(m, blocks, BLOCK)
    scale = block_scales(tiles.abs().amax(-1), FP8_MAX[dtype])
    data = _saturating_cast(tiles, scale.unsqueeze(-1), dtype).reshape(m, blocks * BLOCK)[:, :k].contiguous()
    return data, scale.reciprocal()


def quantize_128x128(t: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`t` [n, k] quantized per 128x128 block: (fp8 data [n, k], inverse scales
    [ceil(n / 128), ceil(k / 128)])."""
    n, k = t.shape
    rows, cols = -(-n // BLOCK), -(-k // BLOCK)
    tiles = _padded(t.detach(), rows * BLOCK, cols * BLOCK).reshape(rows, BLOCK, cols, BLOCK)
    scale = block_scales(tiles.abs().amax(dim=(1, 3)), FP8_MAX[dtype])
    data = _saturating_cast(tiles, scale[:, None, :, None], dtype).reshape(rows * BLOCK, cols * BLOCK)
    return data[:n, :k].contiguous(), scale.reciprocal()


def dequantize(data: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """fp32 values of `data` [m, k] whose inverse scales `scale_inv` are one per `block` of
    elements ((1, 128), (128, 1) or (128, 128); the last block of a dimension may be partial)."""
    m, k = data.shape
    expanded = scale_inv.repeat_interleave(block[0], 0)[:m].repeat_interleave(block[1], 1)[:, :k]
    return data.float() * expanded


def emulated_mm(a, a_scale_inv, b, b_scale_inv, b_block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """dequantize(a) @ dequantize(b) in fp32: the block-scaled GEMM's reference."""
    return (dequantize(a, a_scale_inv, (1, BLOCK)) @ dequantize(b, b_scale_inv, b_block)).to(out_dtype)


def _kernel_serves(a: torch.Tensor, b: torch.Tensor, b_block: tuple[int, int]) -> bool:
    """Whether torch's block-scaled GEMM takes these shapes on this device (module docstring)."""
    if not a.is_cuda or torch.cuda.get_device_capability(a.device) != (9, 0):
        return False
    m, k = a.shape
    n = b.shape[1]
    return k % BLOCK == 0 and m % 16 == 0 and n % b_block[1] == 0 and n % 16 == 0


def _column_major(t: torch.Tensor) -> torch.Tensor:
    return t.t().contiguous().t()


def blockwise_mm(a: torch.Tensor, a_scale_inv: torch.Tensor, b: torch.Tensor, b_scale_inv: torch.Tensor,
                 b_block: tuple[int, int], out_dtype: torch.dtype) -> torch.Tensor:
    """a @ b, accumulated in fp32, for FP8 `a` [m, k] in 1x128 tiles (inverse scales
    [m, k/128]) and `b` [k, n] in `b_block` (128, 1) tiles (inverse scales [k/128, n]) or
    (128, 128) blocks ([k/128, n/128])."""
    if not _kernel_serves(a, b, b_block):
        return emulated_mm(a, a_scale_inv, b, b_scale_inv, b_block, out_dtype)
    # cuBLASLt's layouts: 1x128 scales outer-dimension-major ([m, k/128] with strides [1, m]);
    # 128x128 scales [k/128 padded to a multiple of 4, n/128] with strides [1, that]
    if b_block == (BLOCK, BLOCK):
        k_blocks = b_scale_inv.shape[0]
        scale_b = b_scale_inv.new_ones(b_scale_inv.shape[1], -(-k_blocks // 4) * 4)
        scale_b[:, :k_blocks] = b_scale_inv.t()
        scale_b, recipe_b = scale_b.t(), F.ScalingType.BlockWise128x128
    else:
        scale_b, recipe_b = b_scale_inv.contiguous().t(), F.ScalingType.BlockWise1x128
    return F.scaled_mm(a.contiguous(), _column_major(b), _column_major(a_scale_inv), F.ScalingType.BlockWise1x128,
                       scale_b, recipe_b, output_dtype=out_dtype)


class BlockwiseScaling:
    """The `scaling` of a blockwise FP8 linear: no state (each block's scale comes from its own
    amax at the moment it is quantized) and nothing reduced across ranks."""

    def __init__(self, recipe: Fp8Recipe):
        self.recipe = recipe


class BlockwiseFp8Gemm(Fp8Gemm):
    """One linear's FP8 GEMMs with block scaling (module docstring). The weight's 128x128 cast
    is fp8_gemm.py's cached one: cast once per optimizer step, its column-major copy for dgrad."""

    name = "fp8-blockwise"

    def __init__(self, recipe: Fp8Recipe, parallel_mode: str):
        super().__init__(recipe, BlockwiseScaling(recipe), parallel_mode)

    def _quantized(self, operand: int, tensor: torch.Tensor, record: bool):
        """The weight's cast ([n, k] data, 128x128 inverse scales); the only operand asked of it."""
        assert operand == WEIGHT, operand
        return quantize_128x128(tensor, self.recipe.dtype(WEIGHT))

    def _cast_weight(self, weight, record: bool, column_major: bool):
        """The 128x128 cast; its column-major copy is made from it when dgrad first asks."""
        data, scale_inv = self._quantized(WEIGHT, weight, record)
        return data, None, scale_inv

    def shared_grad(self, grad2d):
        """None: dgrad's 1x128 tiles run along dy's rows, wgrad's along its columns (other bytes)."""
        return None

    def fprop(self, x, weight, bias):
        x2d = x.reshape(-1, x.shape[-1])
        xq, x_scale_inv = quantize_1x128(x2d, self.recipe.dtype(INPUT))
        wq, w_scale_inv = self._weight(weight, record=self.record_forward)
        y = blockwise_mm(xq, x_scale_inv, wq.t(), w_scale_inv.t(), (BLOCK, BLOCK), x.dtype)
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], weight.shape[0])

    def dgrad(self, grad, weight, shared=None):
        grad2d = grad.reshape(-1, grad.shape[-1])
        gq, g_scale_inv = quantize_1x128(grad2d, self.recipe.dtype(GRAD))
        wq, w_scale_inv = self._weight(weight, record=False, column_major=True)
        dx = blockwise_mm(gq, g_scale_inv, wq, w_scale_inv, (BLOCK, BLOCK), grad.dtype)
        return dx.reshape(*grad.shape[:-1], weight.shape[1])

    def _fp8_wgrad(self, grad2d, x2d, out_dtype, shared=None):
        gq, g_scale_inv = quantize_1x128(grad2d.t(), self.recipe.dtype(GRAD))  # [n, T]: tiles along the tokens
        xq, x_scale_inv = quantize_1x128(x2d.t(), self.recipe.dtype(INPUT))  # [k, T]
        return blockwise_mm(gq, g_scale_inv, xq.t(), x_scale_inv.t(), (BLOCK, 1), out_dtype)
