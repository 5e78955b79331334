"""SwiGLU and bias-GeLU Triton kernels vs their torch references, forward and backward."""

import pytest
import torch

from megalite.kernels import bias_gelu, bias_gelu_reference, swiglu, swiglu_reference
from megalite.kernels.activations_triton import bias_gelu_backward_launch
from tests.kernels.checks import (EDGE_SHAPES, assert_forward_close, assert_grad_close, assert_row_sum_close,
                                  grads_fp64, summation_depth)

# Under the interpreter sigmoid's exp(-x) overflows to inf for very negative x (numpy warns); the
# result, 1 / (1 + inf) = 0, is the right one.
pytestmark = pytest.mark.filterwarnings("ignore:overflow encountered in exp:RuntimeWarning")

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = EDGE_SHAPES
# bias-GeLU's four code paths (bias or not, erf or tanh), each at some of the edge shapes in each
# dtype: the shapes take the paths in turn (the cross product compiled 192 kernels on a GPU)
GELU_CASES = [(shape, with_bias, approximate) for shape, (with_bias, approximate) in
              zip(SHAPES, [(True, "none"), (True, "tanh"), (False, "none"), (False, "tanh")] * 2)]


def _randn(shape, dtype, device, g, scale=1.0):
    return (scale * torch.randn(shape, generator=g)).to(device=device, dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_swiglu(shape, dtype, device):
    g = torch.Generator().manual_seed(sum(shape))
    rows, f = shape
    x = _randn((rows, 2 * f), dtype, device, g, scale=3.0).requires_grad_()
    dy = _randn((rows, f), dtype, device, g)
    y = swiglu(x, impl="triton")
    name = f"swiglu {shape} {dtype}"
    assert_forward_close(y, swiglu_reference(x), f"{name} forward")
    (dx,) = torch.autograd.grad(y, [x], dy)
    (expected,) = grads_fp64(swiglu_reference, [x], dy)
    assert_grad_close(dx, expected, dtype, f"{name} dx")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, with_bias, approximate", GELU_CASES, ids=str)
def test_bias_gelu(shape, dtype, with_bias, approximate, device):
    g = torch.Generator().manual_seed(sum(shape))
    rows, f = shape
    x = _randn(shape, dtype, device, g, scale=3.0).requires_grad_()
    bias = _randn((f,), dtype, device, g).requires_grad_() if with_bias else None
    dy = _randn(shape, dtype, device, g)
    y = bias_gelu(x, bias, approximate, impl="triton")
    name = f"bias_gelu {shape} {dtype} bias={with_bias} {approximate}"
    assert_forward_close(y, bias_gelu_reference(x, bias, approximate), f"{name} forward")
    inputs = [x] + ([bias] if with_bias else [])
    grads = torch.autograd.grad(y, inputs, dy)
    expected = grads_fp64(lambda x, b=None: bias_gelu_reference(x, b, approximate), inputs, dy)
    for label, got, want in zip(("dx", "dbias"), grads, expected):
        assert_grad_close(got, want, dtype, f"{name} {label}")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("f", [100, 1100], ids=["one_column_block", "several_column_blocks"])
def test_bias_gelu_backward_sums_row_blocks(f, dtype, device):
    """The backward's programs each take one tile and write its dbias column sums; a second kernel
    sums them over row blocks, the last block partial (per column block when f spans several). In
    fp32 dbias, a sum over hundreds of rows of the kernel's own dx values, is held to the bound on
    summing in another order (checks.assert_row_sum_close)."""
    _, _, block_m, _, _ = bias_gelu_backward_launch(1024, f, True)
    rows = 5 * block_m + 3
    row_blocks, col_blocks, block_m, block_n, _ = bias_gelu_backward_launch(rows, f, True)
    assert row_blocks == 6 and (col_blocks > 1) == (f > block_n)
    g = torch.Generator().manual_seed(rows + f)
    x = _randn((rows, f), dtype, device, g, scale=3.0).requires_grad_()
    bias = _randn((f,), dtype, device, g).requires_grad_()
    dy = _randn((rows, f), dtype, device, g)
    y = bias_gelu(x, bias, "tanh", impl="triton")
    name = f"bias_gelu {rows}x{f} {dtype}"
    assert_forward_close(y, bias_gelu_reference(x, bias, "tanh"), f"{name} forward")
    dx, dbias = torch.autograd.grad(y, [x, bias], dy)
    want_dx, want_dbias = grads_fp64(lambda x, b: bias_gelu_reference(x, b, "tanh"), [x, bias], dy)
    assert_grad_close(dx, want_dx, dtype, f"{name} dx")
    if dtype != torch.float32:
        assert_grad_close(dbias, want_dbias, dtype, f"{name} dbias")
        return
    depth = summation_depth(block_m, row_blocks, row_blocks)
    assert_row_sum_close(dbias, want_dbias, dx.double(), depth, f"{name} dbias")


def test_bias_gelu_backward_tile_fits_the_register_budget():
    """The backward's tile is 2048 elements at 8 a thread (8 warps) with a bias, at most 128
    columns wide so that the dbias partials stay <= 1/8 of dx's bytes (the sm_90 compile test
    checks the registers)."""
    for rows, f in ((16384, 3072), (16384, 14336), (8, 64), (4096, 16384)):
        row_blocks, col_blocks, block_m, block_n, num_warps = bias_gelu_backward_launch(rows, f, True)
        assert block_m * block_n <= 2048 and block_n <= 128 and num_warps <= 8
        assert row_blocks * f * 4 <= rows * f * 2 / 8 or row_blocks == 1
        assert row_blocks * block_m >= rows and col_blocks * block_n >= f


def test_swiglu_3d_strided(device):
    """[s, b, 2f] slice of a wider buffer: the kernel follows the row stride."""
    g = torch.Generator().manual_seed(5)
    base = _randn((3, 2, 40), torch.bfloat16, device, g, scale=2.0)
    x = base[:, :, 3:37].requires_grad_()
    dy = _randn((3, 2, 17), torch.bfloat16, device, g)
    y = swiglu(x, impl="triton")
    assert_forward_close(y, swiglu_reference(x), "swiglu strided forward")
    (dx,) = torch.autograd.grad(y, [x], dy)
    assert_grad_close(dx, grads_fp64(swiglu_reference, [x], dy)[0], torch.bfloat16, "swiglu strided dx")
