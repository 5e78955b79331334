"""--fp8-recipe blockwise (megalite/parallel/tensor/fp8_blockwise.py) against references written
out here independently: Transformer Engine's power-of-2 block scale (fp8_max / amax rounded down
to a power of 2 with math.frexp), each block quantized in a Python loop over the blocks (partial
blocks at the ends of dimensions that are not multiples of 128), the GEMMs of a linear in double
precision on operands dequantized with those scales: fprop x (1x128 along k) by W (128x128),
dgrad dy (1x128 along n) by W, wgrad dy^T by x (both 1x128 along the tokens).

The CUDA path (torch's block-scaled scaled_mm, Hopper only) cannot run here: its scale layouts
are checked by a stand-in that asserts the layouts torch's meta function for _scaled_mm_v2
demands and multiplies by reading the scales in those layouts; the dry run (fake CUDA) runs the
real call's meta checks (tests/planner/test_fp8_planner.py).
"""

import math

import pytest
import torch
import torch.nn.functional as F

from megalite.parallel.tensor import fp8_blockwise
from megalite.parallel.tensor.fp8_blockwise import (BlockwiseFp8Gemm, block_scales, blockwise_mm, quantize_1x128,
                                                    quantize_128x128)
from megalite.parallel.tensor.fp8_scaling import Fp8Recipe
from tests.parallel.tensor.test_fp8_gemm import _fp8_linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def _scale(amax: float, dtype) -> float:
    """Transformer Engine's compute_scale_from_amax with power-of-2 scales, written out."""
    if amax == 0 or math.isinf(amax):
        return 1.0
    mantissa, exponent = math.frexp(MAX[dtype] / amax)  # value = mantissa * 2**exponent, mantissa in [0.5, 1)
    return math.ldexp(1.0, exponent - 1)


def _reference_quantized(t: torch.Tensor, block: tuple[int, int], dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(the dequantized tensor in double, the scales), block by block."""
    out, (m, k) = torch.empty(t.shape, dtype=torch.float64), t.shape
    scales = torch.empty(-(-m // block[0]), -(-k // block[1]), dtype=torch.float64)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            rows, cols = slice(i * block[0], (i + 1) * block[0]), slice(j * block[1], (j + 1) * block[1])
            tile = t[rows, cols].double()
            s = _scale(float(tile.abs().max()), dtype)
            scales[i, j] = s
            out[rows, cols] = (tile * s).clamp(-MAX[dtype], MAX[dtype]).float().to(dtype).double() / s
    return out, scales


def test_block_scales_are_transformer_engines_powers_of_2():
    amax = torch.tensor([0.0, float("inf"), float("nan"), 1e-45, 3.0, 448.0, 447.0, 0.5])
    want = torch.tensor([1.0, 1.0, 1.0, 2.0 ** 127, 128.0, 1.0, 1.0, 512.0])
    assert torch.equal(block_scales(amax, 448.0), want)
    assert torch.equal(block_scales(torch.tensor([1.0]), 57344.0), torch.tensor([32768.0]))


@pytest.mark.parametrize("dtype", [E4M3, E5M2])
def test_quantizers_on_ragged_blocks_equal_the_block_by_block_reference(dtype):
    """[5, 300] in 1x128 tiles (128, 128, 44 wide) and [200, 300] in 128x128 blocks (the last
    row of blocks 72 high, the last column 44 wide), one block scaled far from the others."""
    g = torch.Generator().manual_seed(0)
    t = torch.randn(200, 300, generator=g) * 3
    t[128:, 256:] *= 1e-3  # the last block (72 x 44)
    for quantizer, block, x in ((quantize_1x128, (1, 128), t[:5]), (quantize_128x128, (128, 128), t)):
        data, scale_inv = quantizer(x, dtype)
        want, scales = _reference_quantized(x, block, dtype)
        assert data.dtype == dtype and data.shape == x.shape and scale_inv.shape == scales.shape
        assert torch.equal(scale_inv.double(), 1 / scales)
        assert torch.equal(fp8_blockwise.dequantize(data, scale_inv, block).double(), want)
    assert len(set(_reference_quantized(t, (128, 128), dtype)[1].flatten().tolist())) > 1  # the scales differ


def _operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    # tokens 1e6 apart in magnitude: a tile along the tokens sends the small ones to e4m3's subnormals
    per_token = 10.0 ** (torch.arange(50) % 7 - 3).view(1, 50, 1)
    x = torch.randn(3, 50, 200, generator=g) * 3 * per_token  # 150 tokens, k = 200: partial blocks everywhere
    w = torch.randn(160, 200, generator=g) * 0.05
    w[:, 128:] *= 20  # a weight block column of another magnitude
    b = torch.randn(160, generator=g)
    dy = torch.randn(3, 50, 160, generator=g) * 1e-3 / per_token
    return x, w, b, dy


def _close(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal up to fp32 summation (the largest difference relative to the largest element)."""
    return float((got.double() - want).abs().max()) <= 1e-6 * float(want.abs().max())


def _blockwise_linear(recipe, x, w, b, dy):
    return _fp8_linear(recipe, x, w, b, dy, BlockwiseFp8Gemm(recipe, "column"))


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_blockwise_linear_equals_the_block_quantized_reference(fmt):
    x, w, b, dy = _operands()
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    y, dx, dw, db = _blockwise_linear(Fp8Recipe(format=fmt, scaling="blockwise"), x, w, b, dy)
    x2d, dy2d = x.reshape(-1, 200), dy.reshape(-1, 160)
    xq = _reference_quantized(x2d, (1, 128), E4M3)[0]
    wq = _reference_quantized(w, (128, 128), E4M3)[0]
    gq = _reference_quantized(dy2d, (1, 128), grad_dtype)[0]
    gq_t = _reference_quantized(dy2d.t(), (1, 128), grad_dtype)[0]  # along the tokens
    xq_t = _reference_quantized(x2d.t(), (1, 128), E4M3)[0]
    assert _close(y.reshape(-1, 160), xq @ wq.t() + b.double())
    assert _close(dx.reshape(-1, 200), gq @ wq)
    assert _close(dw, gq_t @ xq_t.t())
    assert torch.equal(db, dy2d.sum(0))
    # wgrad's tiles really run along the tokens: the rowwise-quantized operands give another product
    assert (dw.double() - gq.t() @ xq).abs().max() > 1e-3 * dw.abs().max(), (dw.double() - gq.t() @ xq).abs().max()
    # and FP8 really ran: the unquantized products differ by far more than the tolerances above
    assert (y - F.linear(x, w, b)).abs().max() > 1e-2 and (dw - dy2d.t() @ x2d).abs().max() > 1e-5


def test_no_fp8_wgrad_and_the_fused_accumulation():
    x, w, b, dy = _operands()
    x2d, dy2d = x.reshape(-1, 200), dy.reshape(-1, 160)
    _, dx, dw, _ = _blockwise_linear(Fp8Recipe(scaling="blockwise", wgrad=False), x, w, b, dy)
    assert torch.equal(dw, dy2d.t().mm(x2d))  # the plain GEMM, exactly
    _, dx_fp8, dw_fp8, _ = _blockwise_linear(Fp8Recipe(scaling="blockwise"), x, w, b, dy)
    assert torch.equal(dx, dx_fp8) and not torch.equal(dw, dw_fp8)
    main_grad = torch.full_like(w, 0.25)
    BlockwiseFp8Gemm(Fp8Recipe(scaling="blockwise"), "row").wgrad_accumulate(main_grad, dy2d, x2d)
    assert torch.allclose(main_grad, dw_fp8 + 0.25, rtol=1e-6, atol=1e-9)


def _kernel_stand_in(calls):
    """torch's block-scaled scaled_mm as its meta function checks it (torch 2.13,
    _meta_registrations.py, _scaled_mm_v2): a row-major, b column-major; 1x128 scales [M, K/128]
    with strides [1, M]; b's 1x128 scales [N, K/128] strides [1, N], 128x128 scales
    [round_up(K/128, 4), N/128] strides [1, that]; the product read from those layouts."""
    def scaled_mm(a, b, scale_a, recipe_a, scale_b, recipe_b, output_dtype):
        (m, k), n = a.shape, b.shape[1]
        assert a.stride(1) == 1 and b.stride(0) == 1 and k % 128 == 0 and recipe_a == F.ScalingType.BlockWise1x128
        assert scale_a.shape == (m, k // 128) and scale_a.stride() == (1, m)
        if recipe_b == F.ScalingType.BlockWise128x128:
            l4 = -(-(k // 128) // 4) * 4
            assert scale_b.shape == (l4, n // 128) and scale_b.stride() == (1, l4)
            b_scale = scale_b[:k // 128].repeat_interleave(128, 0).repeat_interleave(128, 1)
        else:
            assert recipe_b == F.ScalingType.BlockWise1x128
            assert scale_b.shape == (n, k // 128) and scale_b.stride() == (1, n)
            b_scale = scale_b.t().repeat_interleave(128, 0)
        calls.append(recipe_b)
        return ((a.float() * scale_a.repeat_interleave(128, 1)) @ (b.float() * b_scale)).to(output_dtype)
    return scaled_mm


def test_scales_handed_to_the_kernel_in_its_layouts(monkeypatch):
    """The kernel path (forced here) gives the emulation's numbers for the three GEMMs, its
    scales in cuBLASLt's layouts: k = 384 (3 blocks, padded to 4 in the 128x128 layout), 256
    tokens; a partial block sends the GEMM to the emulation."""
    calls = []
    monkeypatch.setattr(fp8_blockwise, "_kernel_serves", lambda a, b, block: a.shape[1] % 128 == 0)
    monkeypatch.setattr(F, "scaled_mm", _kernel_stand_in(calls))
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(256, 384, generator=g), torch.randn(256, 384, generator=g)
    dy = torch.randn(256, 256, generator=g)
    w[128:, :128] *= 30
    bias = torch.zeros(256)
    recipe = Fp8Recipe(scaling="blockwise")
    y, dx, dw, _ = _blockwise_linear(recipe, x, w, bias, dy)
    monkeypatch.setattr(fp8_blockwise, "_kernel_serves", lambda a, b, block: False)
    assert calls == [F.ScalingType.BlockWise128x128] * 2 + [F.ScalingType.BlockWise1x128]
    for got, want in zip((y, dx, dw), _blockwise_linear(recipe, x, w, bias, dy)):
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-5)
    calls.clear()
    monkeypatch.setattr(fp8_blockwise, "_kernel_serves", lambda a, b, block: a.shape[1] % 128 == 0)
    _blockwise_linear(recipe, x[:100], w, bias, dy[:100])  # 100 tokens: wgrad emulated
    assert calls == [F.ScalingType.BlockWise128x128] * 2


def test_the_kernel_is_not_asked_off_hopper():
    a = torch.zeros(128, 128, dtype=E4M3)
    assert not fp8_blockwise._kernel_serves(a, a, (128, 128))  # CPU
    assert blockwise_mm(a, torch.ones(128, 1), a, torch.ones(1, 1), (128, 128), torch.float32).abs().max() == 0
