"""flash-linear-attention's chunk_gated_delta_rule (fla-core 0.6, Triton) against megalite's torch
chunked rule on CUDA, forward and backward, as the Gated DeltaNet layer calls it
(megalite.kernels.gated_delta_fla): grouped value heads, a ragged last chunk, packed documents;
and the layer on CUDA choosing fla. Skipped without CUDA or without fla-core (gpu_check.sh
carries its wheel). The argument mapping on CPU: tests/model/test_gdn_fla_path.py."""

import pytest
import torch

from megalite.kernels.gated_delta import chunk_gated_delta_rule, l2norm
from megalite.kernels.gated_delta_fla import fla_chunk_gated_delta_rule

if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)
fla_ops = pytest.importorskip("fla.ops.gated_delta_rule", reason="fla-core does not import (megalite's extra gdn)")


def _inputs(s, b=1, nk=2, nv=4, dk=64, dv=64, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = l2norm(torch.randn(b, s, nk, dk, device="cuda", generator=gen))
    k = l2norm(torch.randn(b, s, nk, dk, device="cuda", generator=gen))
    v = torch.randn(b, s, nv, dv, device="cuda", generator=gen)
    g = -torch.rand(b, s, nv, device="cuda", generator=gen) * 0.5
    beta = torch.rand(b, s, nv, device="cuda", generator=gen)
    return [t.requires_grad_() for t in (q, k, v, g, beta)]


def _relative_errors(got, want):
    return [float((a.detach() - b.detach()).norm() / b.detach().norm()) for a, b in zip(got, want)]


def _output_and_grads(fn, inputs):
    o = fn(*inputs)
    weight = torch.randn(o.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    return [o, *torch.autograd.grad((o * weight).sum(), inputs)]


@pytest.mark.parametrize("s, cu_seqlens", [(200, None), (300, [0, 37, 170, 300])], ids=["ragged", "packed"])
def test_fla_equals_torch_rule(s, cu_seqlens):
    inputs = _inputs(s)
    cu = None if cu_seqlens is None else torch.tensor(cu_seqlens, device="cuda")

    def torch_rule(q, k, v, g, beta):
        q, k = (t.repeat_interleave(v.shape[2] // q.shape[2], dim=2) for t in (q, k))
        return chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=64, cu_seqlens=cu)[0]

    want = _output_and_grads(torch_rule, inputs)
    got = _output_and_grads(lambda *t: fla_chunk_gated_delta_rule(fla_ops.chunk_gated_delta_rule, *t, chunk_size=64,
                                                                   cu_seqlens=cu), inputs)
    errors = _relative_errors(got, want)
    print("relative errors o, dq, dk, dv, dg, dbeta:", ["%.1e" % e for e in errors])
    assert max(errors) < 5e-3, errors  # fp32 inputs; fla's products may run in TF32


def test_layer_on_cuda_runs_fla_and_equals_torch():
    from megalite.model.config import GPTConfig
    from megalite.model.gated_delta_net import GatedDeltaNet
    gdn = dict(linear_attention_freq=1, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
               linear_num_value_heads=4, chunk_size=64)
    config = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=4, vocab_size=64, normalization="RMSNorm",
                       activation="swiglu", add_bias_linear=False, gdn=gdn)
    layer = GatedDeltaNet(config, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, device="cuda", generator=gen) * 0.2)
        layer.A_log.copy_(torch.rand(4, device="cuda", generator=gen).log())
    assert layer._chunk_rule(True) == "fla" and layer.fla_rule is fla_ops.chunk_gated_delta_rule
    calls = []
    layer.fla_rule = lambda *args, **kwargs: calls.append(1) or fla_ops.chunk_gated_delta_rule(*args, **kwargs)
    x = torch.randn(150, 2, 64, device="cuda", requires_grad=True)
    got = layer(x)
    grads_got = torch.autograd.grad(got.square().sum(), [x, layer.in_proj.weight])
    assert calls == [1], "the layer on CUDA did not run fla"
    layer.fla_rule = None  # as without fla-core: the torch rule
    want = layer(x)
    grads_want = torch.autograd.grad(want.square().sum(), [x, layer.in_proj.weight])
    errors = _relative_errors([got, *grads_got], [want, *grads_want])
    print("layer relative errors out, dx, d in_proj:", ["%.1e" % e for e in errors])
    assert max(errors) < 5e-3, errors
