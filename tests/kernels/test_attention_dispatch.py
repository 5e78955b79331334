"""--attention-backend auto and fused against the math kernel, on the `device` fixture's device:
the CPU here, the GPU in tools/benchmarks/gpu_check.sh (TRITON_INTERPRET=0). On a GPU, also
attention_kernels' model of torch's checks against torch itself: the kernel it predicts runs
alone, and each kernel it says is refused is refused by torch (sdpa_kernel([kernel]) raises)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from megalite.model.attention_backends import core_attention
from megalite.model.attention_kernels import call_of, card_of, chosen_kernel, kernel_order

SHAPES = {"gqa-d128": (4, 2, 128, 128), "mha-d64": (4, 4, 64, 64), "mla-192-128": (4, 4, 192, 128)}


def make(device, heads, groups, d_qk, d_v, seq=256, dtype=torch.bfloat16):
    gen = torch.Generator(device=device).manual_seed(0)
    shapes = [(2, heads, seq, d_qk), (2, groups, seq, d_qk), (2, groups, seq, d_v)]
    qkv = [torch.randn(*s, device=device, dtype=dtype, generator=gen).requires_grad_() for s in shapes]
    return qkv, torch.randn(2, heads, seq, d_v, device=device, dtype=dtype, generator=gen)


def run(fn, qkv, grad):
    for t in qkv:
        t.grad = None
    out = fn(*qkv)
    out.backward(grad)
    return [out.detach().float()] + [t.grad.float() for t in qkv]


def math_reference(qkv, grad, scale):
    ref = [t.detach().float().requires_grad_() for t in qkv]
    return run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                              enable_gqa=k.shape[1] != q.shape[1]), ref, grad.float())


@pytest.mark.parametrize("backend", ["auto", "fused"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_backend_matches_math_forward_and_backward(backend, shape, device):
    heads, groups, d_qk, d_v = SHAPES[shape]
    qkv, grad = make(device, heads, groups, d_qk, d_v)
    scale = d_qk ** -0.5
    ours = run(lambda q, k, v: core_attention(q, k, v, None, backend=backend, dropout=0.0, scale=scale), qkv, grad)
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, math_reference(qkv, grad, scale)):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 2e-2, f"{backend} {shape} {name}: relative error {err:.2e}"


@pytest.mark.parametrize("backend", ["auto", "fused"])
def test_backend_with_a_mask_matches_math(backend, device):
    """--reset-attention-mask's and the KV cache's path: a boolean mask (True: attend), no flash kernel."""
    qkv, grad = make(device, 4, 2, 128, 128)
    seq = qkv[0].shape[2]
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril()
    mask[seq // 2:, : seq // 2] = False  # two documents
    mask = mask.expand(2, 1, seq, seq)
    scale = 128 ** -0.5
    ours = run(lambda q, k, v: core_attention(q, k, v, mask, backend=backend, dropout=0.0, scale=scale), qkv, grad)
    ref_in = [t.detach().float().requires_grad_() for t in qkv]
    ref = run(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True),
              ref_in, grad.float())
    for name, a, b in zip(("out", "dq", "dk", "dv"), ours, ref):
        err = ((a - b).abs().max() / b.abs().max()).item()
        assert err < 2e-2, f"{backend} masked {name}: relative error {err:.2e}"


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dropout", [0.0, 0.1, 0.125])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_predicted_kernels_agree_with_torch(shape, dropout, masked, device):
    if device != "cuda":
        pytest.skip("torch's CUDA kernel checks need a GPU")
    heads, groups, d_qk, d_v = SHAPES[shape]
    qkv, grad = make(device, heads, groups, d_qk, d_v)
    seq = qkv[0].shape[2]
    mask = torch.ones(seq, seq, dtype=torch.bool, device=device).tril() if masked else None
    card, call = card_of(None), call_of(*qkv, mask, dropout)
    for backend in ("auto", "fused"):
        kernel, refused = chosen_kernel(kernel_order(backend, card, call), card, call)
        attend = lambda q, k, v: F.scaled_dot_product_attention(  # noqa: E731
            q, k, v, attn_mask=mask, dropout_p=dropout, is_causal=mask is None, enable_gqa=groups != heads)
        with sdpa_kernel([kernel]):
            run(attend, qkv, grad)  # raises "No available kernel" if torch refuses the predicted one
        for other, why, _ in refused:
            with sdpa_kernel([other]), pytest.raises(RuntimeError):
                run(attend, qkv, grad)
                pytest.fail(f"torch ran {other.name}, which attention_kernels refuses ({why}) on {card}")
