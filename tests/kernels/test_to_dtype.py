"""The fp32 -> bf16 conversion every kernel stores through rounds to nearest even, bit for bit
like torch, also under the interpreter (whose own conversion truncates; see triton_common)."""

import pytest
import torch

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from megalite.kernels.triton_common import to_dtype  # noqa: E402 - after the triton check


@triton.jit
def _store_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    x = tl.load(X + offs, mask=ok, other=0.0)
    tl.store(Y + offs, to_dtype(x, Y.dtype.element_ty), mask=ok)


def test_fp32_to_bf16_rounds_to_nearest_even(device):
    g = torch.Generator().manual_seed(0)
    random = torch.randn(20000, generator=g) * torch.logspace(-38, 38, 20000)
    # Exact ties between two bf16 neighbours, both parities, and values that round up into the next binade.
    ties = (torch.arange(1, 2000, dtype=torch.int32) << 16 | 0x8000).view(torch.float32)
    carries = torch.tensor([1.99999988, -1.99999988, 3.3999998e38, 0.0, -0.0, 1e-40, -3e-39])
    x = torch.cat([random, ties, -ties, carries]).to(device)
    y = torch.empty(x.shape, dtype=torch.bfloat16, device=device)
    _store_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    expected = x.to(torch.bfloat16)
    mismatch = (y.view(torch.int16) != expected.view(torch.int16)).nonzero().flatten()
    assert mismatch.numel() == 0, f"{mismatch.numel()} values rounded differently, e.g. {x[mismatch[:5]].tolist()}"


def _fp8_edge_values(dtype: torch.dtype) -> torch.Tensor:
    """Every fp8 value, the midpoints between neighbours (ties: both parities), the midpoints'
    fp32 neighbours on each side, random values across the range, and the saturation region the
    FP8 casts clamp to (finite max, halfway past it), zeros, the subnormals' edge and NaN."""
    finite = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype).float()
    finite = finite[torch.isfinite(finite)].unique()  # sorted, -max .. max, one zero
    mids = (finite[:-1].double() + finite[1:].double()) / 2  # exact in fp32 (fp8 has <= 4 significant bits)
    mids = mids.float()
    below = torch.nextafter(mids, torch.full_like(mids, -float("inf")))
    above = torch.nextafter(mids, torch.full_like(mids, float("inf")))
    g = torch.Generator().manual_seed(0)
    top = float(finite.max())
    random = torch.randn(4000, generator=g) * torch.logspace(-12, 0, 4000) * top
    tiny = float(finite[finite > 0].min())
    special = torch.tensor([0.0, -0.0, tiny / 2, tiny / 4, tiny * 0.75, top, -top, float("nan"), 1e-45, -1e-45])
    return torch.cat([finite, mids, below, above, random, special])


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_fp32_to_fp8_rounds_to_nearest_even_like_torch(device, dtype):
    """Bit for bit against torch's conversion (with e4m3fn, also past the largest finite value and
    at infinity: torch saturates to 448 like the hardware's satfinite conversion). The
    interpreter's own conversion turned [124.8, 127] into 64 instead of 128."""
    x = _fp8_edge_values(dtype)
    if dtype == torch.float8_e4m3fn:
        x = torch.cat([x, torch.tensor([449.0, 463.9, 464.0, 479.0, 480.0, 1e6, float("inf"), -float("inf")])])
    x = x.to(device)
    y = torch.empty(x.shape, dtype=dtype, device=device)
    _store_kernel[(triton.cdiv(x.numel(), 1024),)](x, y, x.numel(), BLOCK=1024)
    expected = x.to(dtype)
    mismatch = (y.view(torch.uint8) != expected.view(torch.uint8)).nonzero().flatten()
    assert mismatch.numel() == 0, (f"{mismatch.numel()} of {x.numel()} values converted differently, e.g. "
                                   f"{x[mismatch[:5]].tolist()} -> {y[mismatch[:5]].view(torch.uint8).tolist()}, "
                                   f"torch {expected[mismatch[:5]].view(torch.uint8).tolist()}")
