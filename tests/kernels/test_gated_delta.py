"""The chunked gated delta rule against its recurrent form and transformers' Qwen3-Next torch
references (fp32, forward and backward): ragged chunks, packed documents, initial states."""

import pytest
import torch

from megalite.kernels.gated_delta import (chunk_gated_delta_rule, document_cu_seqlens, l2norm,
                                          recurrent_gated_delta_rule)

qwen3_next = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def _inputs(b=2, s=13, h=3, dk=8, dv=6, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(b, s, h, dk, generator=gen, dtype=torch.float64)).float()
    k = l2norm(torch.randn(b, s, h, dk, generator=gen, dtype=torch.float64)).float()
    v = torch.randn(b, s, h, dv, generator=gen)
    g = -torch.rand(b, s, h, generator=gen) * 0.7
    beta = torch.rand(b, s, h, generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _outputs_and_grads(fn, inputs, *args, **kwargs):
    o, state = fn(*inputs, *args, **kwargs)
    gen = torch.Generator().manual_seed(1)
    loss = (o * torch.randn(o.shape, generator=gen)).sum() + (state * torch.randn(state.shape, generator=gen)).sum()
    grads = torch.autograd.grad(loss, inputs)
    return (o, state, *grads)


def _close(got, want, atol=1e-5):
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=atol, rtol=1e-5)


@pytest.mark.parametrize("chunk_size", [1, 4, 5, 13, 64])
def test_chunked_equals_recurrent_for_ragged_chunks(chunk_size):
    inputs = _inputs()
    state0 = torch.randn(2, 3, 8, 6, generator=torch.Generator().manual_seed(2)).requires_grad_()
    want = _outputs_and_grads(recurrent_gated_delta_rule, inputs + [state0])
    got = _outputs_and_grads(lambda *t: chunk_gated_delta_rule(*t[:5], chunk_size=chunk_size, initial_state=t[5]),
                             inputs + [state0])
    _close(got, want)


def test_against_transformers_torch_references():
    inputs = _inputs(s=11)
    want_chunk = _outputs_and_grads(
        lambda *t: qwen3_next.torch_chunk_gated_delta_rule(*t, chunk_size=4, output_final_state=True), inputs)
    want_rec = _outputs_and_grads(
        lambda *t: qwen3_next.torch_recurrent_gated_delta_rule(*t, output_final_state=True), inputs)
    _close(_outputs_and_grads(lambda *t: chunk_gated_delta_rule(*t, chunk_size=4), inputs), want_chunk)
    _close(_outputs_and_grads(recurrent_gated_delta_rule, inputs), want_rec)


def test_packed_documents_reset_the_state():
    """Three documents packed in one row equal three separate runs; a recurrent state carried
    across a boundary would differ."""
    q, k, v, g, beta = _inputs(b=1, s=17)
    bounds = [0, 5, 6, 17]
    got = _outputs_and_grads(lambda *t: chunk_gated_delta_rule(*t, chunk_size=4,
                                                               cu_seqlens=torch.tensor(bounds)), [q, k, v, g, beta])

    def separate(*t):
        outs, states = [], []
        for a, b in zip(bounds, bounds[1:]):
            o, st = recurrent_gated_delta_rule(*(x[:, a:b] for x in t))
            outs.append(o)
            states.append(st)
        return torch.cat(outs, dim=1), torch.cat(states)

    want = _outputs_and_grads(separate, [q, k, v, g, beta])
    _close(got, want)
    unpacked, _ = chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=4)
    assert (unpacked[:, 5:] - got[0][:, 5:]).abs().max() > 1e-3


def test_document_cu_seqlens_lays_rows_end_to_end():
    starts = torch.zeros(2, 6, dtype=torch.bool)
    starts[0, 4] = starts[1, 2] = True
    assert document_cu_seqlens(starts).tolist() == [0, 4, 6, 8, 12]


def test_bad_cu_seqlens_refused():
    q, k, v, g, beta = _inputs(b=1, s=8)
    with pytest.raises(ValueError, match="cu_seqlens"):
        chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 3, 7]))
