"""RMSNorm / LayerNorm Triton kernels vs their torch references, forward and backward."""

import math

import pytest
import torch
import triton

from megalite.kernels import layer_norm, layer_norm_reference, rms_norm, rms_norm_reference
from tests.kernels.checks import (EDGE_SHAPES, assert_forward_close, assert_grad_close, assert_partial_sums_close,
                                  assert_row_sum_close, grads_fp64, rows_with_several_blocks_per_program,
                                  summation_depth)

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = EDGE_SHAPES


def _inputs(shape, dtype, device, seed, weight_dtype=None):
    g = torch.Generator().manual_seed(seed)
    h = shape[-1]
    x = (2 * torch.randn(shape, generator=g) + 0.5).to(device=device, dtype=dtype).requires_grad_()
    w = (1 + 0.5 * torch.randn(h, generator=g)).to(device=device, dtype=weight_dtype or dtype).requires_grad_()
    b = torch.randn(h, generator=g).to(device=device, dtype=weight_dtype or dtype).requires_grad_()
    dy = torch.randn(shape, generator=g).to(device=device, dtype=dtype)
    return x, w, b, dy


def _check(name, op, reference, x, params, dy):
    y = op(x, *params, impl="triton")
    assert_forward_close(y, reference(x, *params), f"{name} forward", bf16_ulps=2 if op is rms_norm else 1)
    inputs = [x] + [p for p in params if isinstance(p, torch.Tensor)]
    grads = torch.autograd.grad(y, inputs, dy)
    expected = grads_fp64(lambda *t: reference(*t, *params[len(inputs) - 1:]), inputs, dy)
    for label, got, want, t in zip(("dx", "dweight", "dbias"), grads, expected, inputs):
        assert_grad_close(got, want, t.dtype, f"{name} {label}", activation_dtype=x.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_rms_norm(shape, dtype, device):
    x, w, _, dy = _inputs(shape, dtype, device, seed=sum(shape))
    _check(f"rms_norm {shape} {dtype}", rms_norm, rms_norm_reference, x, [w, 1e-6], dy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_layer_norm(shape, dtype, device):
    x, w, b, dy = _inputs(shape, dtype, device, seed=sum(shape))
    _check(f"layer_norm {shape} {dtype}", layer_norm, layer_norm_reference, x, [w, b, 1e-5], dy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_layer_norm_without_bias(dtype, device):
    x, w, _, dy = _inputs((5, 33), dtype, device, seed=7)
    _check(f"layer_norm no bias {dtype}", layer_norm, layer_norm_reference, x, [w, None, 1e-5], dy)


@pytest.mark.parametrize("op, reference, n_params", [(rms_norm, rms_norm_reference, 1),
                                                     (layer_norm, layer_norm_reference, 2)], ids=["rms", "layer"])
def test_strided_3d_input_and_fp32_params(op, reference, n_params, device):
    """[s, b, h] slices of a wider buffer (row stride != h), bf16 activations with fp32 parameters."""
    big, w, b, _ = _inputs((4, 3, 50), torch.bfloat16, device, seed=11, weight_dtype=torch.float32)
    x = big.detach()[:, :, 5:38].requires_grad_()
    assert not x.is_contiguous()
    w, b = w.detach()[:33].requires_grad_(), b.detach()[:33].requires_grad_()
    dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(3)).to(device=device, dtype=x.dtype)
    params = [w, b][:n_params] + [1e-5]
    _check(f"{op.__name__} strided", op, reference, x, params, dy)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("h", [33, 130])
@pytest.mark.parametrize("op", ["rms_norm", "layer_norm"])
def test_backward_programs_loop_over_row_blocks(op, h, dtype, device):
    """The backward's programs each take several row blocks, the last one partial: their running
    dweight/dbias sums add up every block. In fp32 the sums over thousands of rows are held to the
    bound on summing in another order: each program's partial sums over its own rows
    (checks.assert_partial_sums_close), then the gradient (checks.assert_row_sum_close)."""
    from megalite.kernels import norms_triton
    from megalite.kernels.triton_common import direct, sm_count

    sms = sm_count(torch.device(device))
    rows = rows_with_several_blocks_per_program(lambda n: norms_triton.backward_launch(n, h, sms)[:2])
    is_rms = op == "rms_norm"
    x, w, b, dy = _inputs((rows, h), dtype, device, seed=rows + h)
    fn, reference = (rms_norm, rms_norm_reference) if is_rms else (layer_norm, layer_norm_reference)
    params = [w, 1e-6] if is_rms else [w, b, 1e-5]
    name = f"{op} {rows}x{h} {dtype}"
    if dtype != torch.float32:
        _check(name, fn, reference, x, params, dy)
        return
    y = fn(x, *params, impl="triton")
    assert_forward_close(y, reference(x, *params), f"{name} forward")
    leaves = [x, w] if is_rms else [x, w, b]
    got = torch.autograd.grad(y, leaves, dy)
    want = grads_fp64(lambda *t: reference(*t, params[-1]), leaves, dy)
    assert_grad_close(got[0], want[0], dtype, f"{name} dx")
    # The kernel's terms: dy * xhat with xhat from its own saved statistics (two roundings for
    # RMSNorm's x * rstd and the product, three for LayerNorm's (x - mean) * rstd), and dy for dbias.
    xd, wd, bd = x.detach(), w.detach(), None if is_rms else b.detach()
    _, mean, rstd = norms_triton.norm_forward(xd, wd, bd, params[-1], is_rms)
    x64, dy64 = xd.double().cpu(), dy.double().cpu()
    stats = rstd.double().cpu()[:, None]
    xhat64 = x64 * stats if is_rms else (x64 - mean.double().cpu()[:, None]) * stats
    terms = {"dweight": (dy64 * xhat64, 2 if is_rms else 3), "dbias": (dy64, 0)}
    # Each program's own partial sums, as the kernel wrote them...
    launch = norms_triton.backward_launch(rows, h, sms)
    programs, block_m = launch[:2]
    parts = {k: torch.empty((programs, h), dtype=torch.float32, device=device) for k in terms}
    norms_triton._launch_backward(dy, xd, wd, torch.empty_like(xd), None if is_rms else mean, rstd, parts["dweight"],
                                  None if is_rms else parts["dbias"], is_rms, (rows, h, h), h, launch, direct)
    blocks_per_program = triton.cdiv(triton.cdiv(rows, block_m), programs)
    for (label, (t, roundings)), grad in zip(terms.items(), got[1:]):
        depth = summation_depth(block_m, triton.cdiv(rows, block_m), programs)
        # ... held to the bound over their own rows, then the result after the column-sum kernel's sum over them.
        assert_partial_sums_close(parts[label], t, block_m, math.ceil(math.log2(block_m)) + blocks_per_program
                                  + roundings, f"{name} {label} partial sums")
        assert_row_sum_close(grad, want[1 if label == "dweight" else 2], t.to(grad.device), depth + roundings,
                             f"{name} {label}")
