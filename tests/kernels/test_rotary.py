"""Rotary embedding Triton kernel vs its torch reference, forward and backward."""

import pytest
import torch

from megalite.kernels import apply_rotary, apply_rotary_reference
from tests.kernels.checks import assert_forward_close, assert_grad_close, grads_fp64

DTYPES = [torch.float32, torch.bfloat16]
# (s, b, n, d, d_rot, batch dim of cos/sin): full and partial rotation, per-sample positions.
CASES = [(1, 1, 1, 2, 2, 1), (3, 2, 3, 8, 4, 2), (5, 3, 4, 10, 6, 1), (7, 2, 5, 16, 16, 2),
         (17, 1, 3, 130, 64, 1), (4, 3, 2, 33, 2, 3)]


def _cos_sin(s, batch, d_rot, g, device):
    positions = torch.randint(0, 4096, (s, batch, 1), generator=g).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, d_rot, 2).float() / d_rot))
    freqs = positions * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(device), emb.sin().to(device)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", CASES, ids=str)
def test_rotary(case, dtype, device):
    s, b, n, d, d_rot, batch = case
    g = torch.Generator().manual_seed(sum(case))
    # x is a slice of a fused [s, b, n, 3d] buffer (as q out of QKV): strided heads.
    qkv = torch.randn((s, b, n, 3 * d), generator=g).to(device=device, dtype=dtype)
    x = qkv[..., d:2 * d].requires_grad_()
    cos, sin = _cos_sin(s, batch, d_rot, g, device)
    dy = torch.randn((s, b, n, d), generator=g).to(device=device, dtype=dtype)
    name = f"rotary {case} {dtype}"
    y = apply_rotary(x, cos, sin, impl="triton")
    assert_forward_close(y, apply_rotary_reference(x, cos, sin), f"{name} forward")
    if d_rot < d:
        assert torch.equal(y[..., d_rot:], x[..., d_rot:]), f"{name}: pass-through channels changed"
    (dx,) = torch.autograd.grad(y, [x], dy)
    (expected,) = grads_fp64(lambda t: apply_rotary_reference(t, cos.double(), sin.double()), [x], dy)
    assert_grad_close(dx, expected, dtype, f"{name} dx")


def test_rotary_rejects_bad_cos(device):
    x = torch.zeros(3, 2, 1, 8, device=device)
    with pytest.raises(ValueError, match="cos/sin must be"):
        apply_rotary(x, torch.zeros(3, 3, 8, device=device), torch.zeros(3, 3, 8, device=device), impl="triton")
    with pytest.raises(ValueError, match="must be even"):
        apply_rotary(x, torch.zeros(3, 1, 5, device=device), torch.zeros(3, 1, 5, device=device), impl="triton")
