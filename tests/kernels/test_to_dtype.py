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
