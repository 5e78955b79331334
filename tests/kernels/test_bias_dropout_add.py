"""Bias-dropout-add, residual + dropout(x + bias, p): the Triton kernel against the unfused torch
ops. Without dropout, bit for bit. With dropout the kernel's mask is its own (Philox from a seed
drawn from torch's generator; megalite/kernels/bias_dropout_add.py says why it cannot be
F.dropout's), so its numbers are checked against the reference evaluated with the kernel's own
mask, read back from the backward (which regenerates it), and the mask's distribution is tested."""

import math

import pytest
import torch
import triton
import triton.language as tl

from megalite.kernels import bias_dropout_add, bias_dropout_add_reference
from megalite.kernels.bias_dropout_add_triton import _philox
from tests.kernels.checks import assert_close
from tests.kernels.test_fake_tensors import OpLog

DTYPES = [torch.float32, torch.bfloat16]
SHAPES = [(3, 33), (5, 2, 130), (6, 1100)]  # one column block of 64 .. several of 1024


def _inputs(shape, dtype, device, seed=0, bias=True):
    g = torch.Generator().manual_seed(seed)

    def randn(*s):
        return torch.randn(s, generator=g).to(device=device, dtype=dtype).requires_grad_()
    return randn(*shape), randn(shape[-1]) if bias else None, randn(*shape), randn(*shape).detach()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape, with_bias", zip(SHAPES, [True, False, True]), ids=str)
def test_without_dropout_it_is_the_unfused_ops_bit_for_bit(shape, dtype, with_bias, device):
    x, bias, residual, dy = _inputs(shape, dtype, device, bias=with_bias)
    inputs = [t for t in (x, bias, residual) if t is not None]
    got = bias_dropout_add(x, bias, residual, 0.0, impl="triton")
    want = bias_dropout_add_reference(x, bias, residual, 0.0)
    assert torch.equal(got, want)
    grads = torch.autograd.grad(got, inputs, dy)
    expected = torch.autograd.grad(want, inputs, dy)
    for name, g, e in zip(("dx", "dbias", "dresidual") if with_bias else ("dx", "dresidual"), grads, expected):
        if name == "dbias":  # a sum over rows, in fp32 either way, rounded once to the bias dtype
            assert_close(g, e, rtol=2.0 ** -7 if dtype == torch.bfloat16 else 1e-6, atol=1e-6, name=name)
        else:
            assert torch.equal(g, e), name


def _expected_with_mask(x, bias, residual, keep, p):
    """The unfused ops' numbers with the mask `keep`: (x + bias) rounded, times the fp32 scale
    rounded (as CUDA's dropout), plus the residual rounded."""
    biased = x if bias is None else x + bias
    dropped = torch.where(keep, biased.float() * (1.0 / (1.0 - p)), 0.0).to(x.dtype)
    return residual + dropped


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_dropout_is_the_unfused_ops_with_the_kernels_mask(shape, dtype, device):
    """The backward regenerates the forward's mask: d residual is d out, dx is d out * scale where
    kept and 0 where dropped, and the forward is the reference with that same mask (a backward
    drawing another mask fails the forward's equality). dbias is the sum of dx over the rows."""
    p = 0.25
    x, bias, residual, dy = _inputs(shape, dtype, device)
    dy = dy.abs() + 0.5  # never 0: a 0 in dx then means dropped
    out = bias_dropout_add(x, bias, residual, p, impl="triton")
    dx, dbias, dresidual = torch.autograd.grad(out, [x, bias, residual], dy)
    assert torch.equal(dresidual, dy)
    keep = dx != 0
    assert 0 < keep.sum() < keep.numel()
    assert torch.equal(dx, torch.where(keep, dy.float() * (1.0 / (1.0 - p)), 0.0).to(dtype))
    assert torch.equal(out, _expected_with_mask(x, bias, residual, keep, p))
    want_dbias = dx.double().reshape(-1, shape[-1]).sum(0)
    assert_close(dbias, want_dbias, rtol=2.0 ** -7 if dtype == torch.bfloat16 else 1e-6, atol=1e-6, name="dbias")


def _mask(rows, cols, p, seed, device):
    """The kernel's keep mask for `seed` (int) on [rows, cols], read from the forward with x = 1,
    no bias and a zero residual."""
    from megalite.kernels import bias_dropout_add_triton

    ones = torch.ones(rows, cols, device=device)
    return bias_dropout_add_triton.bias_dropout_add(ones, None, torch.zeros_like(ones),
                                                    torch.tensor([seed], device=device), p) != 0


def test_the_mask_is_bernoulli_and_independent(device):
    """Over 64 x 1024 elements, p = 0.1: the kept fraction within 5 standard deviations of 0.9 as a
    whole, in each of the four values of a Philox call (each quarter of a column block) and in
    every row; no two rows alike; other seeds give other masks; and a shorter tensor (other tiles)
    gets the same mask on its rows (the mask depends on the seed and the element, not the launch)."""
    rows, cols, p = 64, 1024, 0.1
    keep = _mask(rows, cols, p, 1234, device).cpu()

    def within(sample: torch.Tensor) -> bool:
        n = sample.numel()
        return abs(sample.float().mean().item() - (1 - p)) < 5 * math.sqrt(p * (1 - p) / n)
    assert within(keep)
    for lane in range(4):
        assert within(keep[:, lane * 256:(lane + 1) * 256]), lane
    assert all(within(row) for row in keep)
    assert len({tuple(row.tolist()) for row in keep}) == rows
    for lane in range(1, 4):  # the four values of one call differ
        assert not torch.equal(keep[:, :256], keep[:, lane * 256:(lane + 1) * 256])
    other = _mask(rows, cols, p, 1235, device).cpu()
    assert abs((keep == other).float().mean().item() - (p * p + (1 - p) ** 2)) < 0.01  # as independent masks agree
    assert torch.equal(_mask(3, cols, p, 1234, device).cpu(), keep[:3])


def test_the_seed_comes_from_torchs_generator(device):
    """The same RNG state gives the same output (a checkpoint's recompute restores the state);
    the next call draws another mask."""
    x, bias, residual, _ = _inputs((8, 64), torch.float32, device)
    torch.manual_seed(7)
    first = bias_dropout_add(x, bias, residual, 0.5, impl="triton")
    second = bias_dropout_add(x, bias, residual, 0.5, impl="triton")
    torch.manual_seed(7)
    again = bias_dropout_add(x, bias, residual, 0.5, impl="triton")
    assert torch.equal(first, again) and not torch.equal(first, second)


def test_eager_path_and_operator_path_agree_with_dropout(device):
    """The same seed through megalite's Function and through the operator's registered autograd
    (under a dispatch mode, as FakeTensorMode and torch.compile see it): same numbers bit for bit."""
    from megalite.kernels import bias_dropout_add_triton

    x, bias, residual, dy = _inputs((4, 2, 48), torch.bfloat16, device)
    seed = torch.tensor([99], device=device)
    results = []
    for mode in (None, OpLog()):
        if mode is None:
            out = bias_dropout_add_triton.bias_dropout_add(x, bias, residual, seed, 0.3)
            grads = torch.autograd.grad(out, [x, bias, residual], dy)
        else:
            with mode:
                out = bias_dropout_add_triton.bias_dropout_add(x, bias, residual, seed, 0.3)
                grads = torch.autograd.grad(out, [x, bias, residual], dy)
            assert {"megalite_kernels.bias_dropout_add_forward.default",
                    "megalite_kernels.bias_dropout_add_backward.default"} <= mode.names, mode.names
        results.append((out, *grads))
    for got, want in zip(*results):
        assert torch.equal(got, want)


def test_strided_inputs(device):
    """A residual or x that is a transposed view ([b, s, h] seen as [s, b, h]) is read by strides."""
    x, bias, residual, _ = _inputs((3, 5, 40), torch.float32, device)
    xt, rt = x.detach().transpose(0, 1), residual.detach().transpose(0, 1)
    assert torch.equal(bias_dropout_add(xt, bias, rt, 0.0, impl="triton"),
                       bias_dropout_add_reference(xt, bias, rt, 0.0))


@triton.jit
def _philox_kernel(C, K, OUT):
    i = tl.arange(0, 2)
    c0 = tl.load(C + i * 4).to(tl.uint32)
    c1 = tl.load(C + i * 4 + 1).to(tl.uint32)
    c2 = tl.load(C + i * 4 + 2).to(tl.uint32)
    c3 = tl.load(C + i * 4 + 3).to(tl.uint32)
    k0 = tl.load(K + i * 2).to(tl.uint32)
    k1 = tl.load(K + i * 2 + 1).to(tl.uint32)
    r0, r1, r2, r3 = _philox(c0, c1, c2, c3, k0, k1)
    tl.store(OUT + i * 4, r0.to(tl.int64))
    tl.store(OUT + i * 4 + 1, r1.to(tl.int64))
    tl.store(OUT + i * 4 + 2, r2.to(tl.int64))
    tl.store(OUT + i * 4 + 3, r3.to(tl.int64))


def test_philox_known_answers(device):
    """Random123's known-answer vectors for Philox-4x32-10 (kat_vectors): the kernel's generator is
    that Philox, not a look-alike."""

    counters = [[0, 0, 0, 0], [0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]]
    keys = [[0, 0], [0xA4093822, 0x299F31D0]]
    want = [[0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8], [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]]
    out = torch.zeros(8, dtype=torch.int64, device=device)
    _philox_kernel[(1,)](torch.tensor(counters, device=device), torch.tensor(keys, device=device), out)
    assert out.view(2, 4).tolist() == want


@pytest.mark.parametrize("call, message", [
    (lambda x, b, r: bias_dropout_add(x, b, r[:-1], 0.1), "residual (2, 8) must have x's shape (3, 8)"),
    (lambda x, b, r: bias_dropout_add(x, b[:-1], r, 0.1), "bias must have shape (8,)"),
    (lambda x, b, r: bias_dropout_add(x, b, r, 1.0), "dropout probability must be in [0, 1), got 1.0"),
    (lambda x, b, r: bias_dropout_add(x, b, r.double(), 0.1, impl="triton"), "needs x, bias and residual of one"),
])
def test_bad_inputs_are_named(call, message, device):
    x, b, r = (torch.randn(*shape, device=device) for shape in ((3, 8), (8,), (3, 8)))
    with pytest.raises(ValueError) as error:
        call(x, b, r)
    assert message in str(error.value) and str(error.value).startswith("bias_dropout_add: ")


def test_auto_with_mixed_dtypes_is_the_reference():
    """A residual kept in fp32 (as --fp32-residual-connection would) with bf16 x: the reference, which promotes."""
    x, r = torch.randn(3, 8, dtype=torch.bfloat16), torch.randn(3, 8)
    out = bias_dropout_add(x, None, r, 0.0)
    assert out.dtype == torch.float32 and torch.equal(out, r + x)
