"""The explicit attention backends (unfused, local) in 16 bits: by default the scores and the
probabilities kept for backward are 16-bit (the softmax computed in fp32), as Megatron's fused
softmax kernel — 2 bytes per score, and with dropout Korthikanti et al.'s 5 (probabilities,
1-byte CUDA dropout mask, dropout output) — and no fp32 copies of q and k;
--attention-softmax-in-fp32 keeps the fp32 path (6 bytes per score without dropout: the fp32
probabilities and their 16-bit cast). Both agree with fp32 attention within 16-bit rounding,
forward and backward."""

import pytest
import torch

from megalite.model.attention_backends import explicit_attention

B, N, S, D = 2, 4, 64, 32


def _inputs(dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, N, S, D, generator=g).to(dtype).requires_grad_() for _ in range(3)]


def saved_bytes(fn) -> dict[str, int]:
    """Bytes of the tensors autograd keeps for backward while fn runs, split into tensors of the
    score shape [b, n, s, s] (broadcast masks included) and the rest."""
    kept = {"scores": 0, "other": 0}
    seen = set()

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in seen:
            seen.add(storage.data_ptr())
            kind = "scores" if t.shape[-2:] == (S, S) else "other"
            kept[kind] += storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return kept


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("softmax_in_fp32", [False, True])
def test_16_bit_attention_matches_fp32(dtype, softmax_in_fp32):
    q, k, v = _inputs(dtype)
    out = explicit_attention(q, k, v, None, dropout=0.0, scale=D ** -0.5, softmax_in_fp32=softmax_in_fp32)
    assert out.dtype == dtype
    out.float().pow(2).sum().backward()
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    ref = explicit_attention(q32, k32, v32, None, dropout=0.0, scale=D ** -0.5)
    ref.pow(2).sum().backward()
    tol = dict(rtol=0.05, atol=0.05) if dtype == torch.bfloat16 else dict(rtol=0.01, atol=0.01)
    torch.testing.assert_close(out.float(), ref, **tol)
    for ours, theirs in ((q, q32), (k, k32), (v, v32)):
        torch.testing.assert_close(ours.grad.float(), theirs.grad, **tol)


def test_default_keeps_16_bit_probabilities_and_no_fp32_copies():
    q, k, v = _inputs(torch.bfloat16)
    lean = saved_bytes(lambda: explicit_attention(q, k, v, None, dropout=0.0, scale=0.2, softmax_in_fp32=False))
    wide = saved_bytes(lambda: explicit_attention(q, k, v, None, dropout=0.0, scale=0.2, softmax_in_fp32=True))
    scores, causal_mask = B * N * S * S, S * S
    assert lean["scores"] == 2 * scores + causal_mask  # the 16-bit probabilities (softmax and matmul share them)
    assert wide["scores"] == 6 * scores + causal_mask  # fp32 probabilities for the softmax, 16-bit for the matmul
    assert lean["other"] == 3 * B * N * S * D * 2  # q, k, v in 16 bits
    assert wide["other"] == lean["other"] + 2 * B * N * S * D * (4 - 2)  # q and k kept in fp32 instead


def test_fp32_is_the_same_either_way():
    q, k, v = _inputs(torch.float32)
    a = explicit_attention(q, k, v, None, dropout=0.0, scale=0.2, softmax_in_fp32=False)
    b = explicit_attention(q, k, v, None, dropout=0.0, scale=0.2, softmax_in_fp32=True)
    assert torch.equal(a, b)
