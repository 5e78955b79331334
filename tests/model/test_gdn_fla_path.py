"""Gated DeltaNet's chunked rule from flash-linear-attention (fla-core) or megalite's torch rule:
the dispatch decision, and the argument mapping to fla's chunk_gated_delta_rule checked through
the fla stand-in (tests/checkpoint/fla_standin: fla's API computed token by token in torch) with
the dispatch forced on this CPU: the layer's output and gradients equal the torch path's. The
real fla kernel against the torch rule on CUDA: tests/kernels/test_gated_delta_fla_cuda.py."""

import sys
from pathlib import Path

import pytest
import torch

from megalite.kernels.dispatch import on_real_cuda
from megalite.kernels.gated_delta_fla import choose_chunk_rule, find_fla_chunk_rule, run_chunk_rule_line
from megalite.model import gated_delta_net
from megalite.model.config import GPTConfig
from megalite.model.gdn_config import GDNConfig
from tests.model.test_gated_delta_net import seeded_layer

FLA_STANDIN = str(Path(__file__).parents[1] / "checkpoint" / "fla_standin")


def fake_rule(*args, **kwargs):
    raise AssertionError("not called")


@pytest.mark.parametrize("on_cuda, fla_rule, deterministic, chunk_size, want, says", [
    (True, fake_rule, False, 64, "fla", "flash-linear-attention's chunk_gated_delta_rule"),
    (True, fake_rule, False, 16, "fla", "flash-linear-attention's"),
    (False, fake_rule, False, 64, "torch", "not on CUDA"),
    (True, None, False, 64, "torch", "pip install fla-core==0.6.0"),
    (True, fake_rule, True, 64, "torch", "--deterministic-mode"),
    (True, fake_rule, False, 8, "torch", "chunk size 8 is not one fla takes"),
])
def test_dispatch_decision(on_cuda, fla_rule, deterministic, chunk_size, want, says):
    rule, line = choose_chunk_rule(on_cuda, chunk_size, fla_rule, deterministic)
    assert rule == want and says in line


def test_fla_found_only_where_it_imports():
    class Module:
        chunk_gated_delta_rule = fake_rule

    def missing(name):
        raise ImportError(f"No module named {name!r}")

    assert find_fla_chunk_rule(lambda name: Module if name == "fla.ops.gated_delta_rule" else None) is fake_rule
    assert find_fla_chunk_rule(missing) is None
    gdn = GDNConfig(linear_attention_freq=2)
    assert "not on CUDA" in run_chunk_rule_line(gdn, "cpu") and run_chunk_rule_line(None, "cpu") is None


def test_a_dry_runs_fake_cuda_is_not_cuda_for_the_choice():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
    fake_cuda = FakeTensor(FakeTensorMode(), torch.empty(2, 3, device="meta"), torch.device("cuda"))
    assert fake_cuda.is_cuda and not on_real_cuda(fake_cuda) and not on_real_cuda(torch.ones(2))


@pytest.fixture
def standin_rule(monkeypatch):
    """fla's chunk_gated_delta_rule from the stand-in (on sys.path for this test only), counting calls."""
    monkeypatch.syspath_prepend(FLA_STANDIN)
    before = set(sys.modules)
    rule = find_fla_chunk_rule()
    assert rule is not None, "the fla stand-in did not import"
    calls = []

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return rule(*args, **kwargs)
    yield counted, calls
    for name in set(sys.modules) - before:
        if name == "fla" or name.startswith("fla."):
            del sys.modules[name]


def _document_mask(starts, s):
    doc = torch.zeros(s, dtype=torch.long)
    for start in starts:
        doc[start:] += 1
    return ~((doc[:, None] == doc[None, :]) & torch.ones(s, s, dtype=torch.bool).tril())


def _output_and_grads(layer, x, mask):
    x = x.clone().requires_grad_()
    out = layer(x, attention_mask=mask)
    loss = (out * torch.randn(out.shape, generator=torch.Generator().manual_seed(3))).sum()
    grads = torch.autograd.grad(loss, [x] + list(layer.parameters()))
    return [out.detach(), *grads]


@pytest.mark.parametrize("packed", [False, True], ids=["rows", "packed_documents"])
def test_fla_mapping_equals_torch_path(standin_rule, monkeypatch, packed):
    """fp32, 2 key heads for 4 value heads (fla's grouped values), 21 tokens in chunks of 16 (a
    ragged last chunk); packed: documents starting at 6 and 17 in each of two rows."""
    rule, calls = standin_rule
    gdn = dict(linear_attention_freq=1, linear_key_head_dim=8, linear_value_head_dim=4, linear_num_key_heads=2,
               linear_num_value_heads=4, chunk_size=16)
    config = GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64, normalization="RMSNorm",
                       activation="swiglu", add_bias_linear=False, gdn=gdn)
    layer, gen = seeded_layer(config)
    x = torch.randn(21, 2, 32, generator=gen)
    mask = _document_mask([6, 17], 21)[None, None] if packed else None
    want = _output_and_grads(layer, x, mask)
    assert not calls
    monkeypatch.setattr(gated_delta_net, "on_real_cuda", lambda t: True)  # this CPU taken for CUDA
    layer.fla_rule, layer.fla_looked_up = rule, True
    got = _output_and_grads(layer, x, mask)
    assert len(calls) == 1 and calls[0]["chunk_size"] == 16 and (calls[0]["cu_seqlens"] is not None) == packed
    if packed:
        assert calls[0]["cu_seqlens"].tolist() == [0, 6, 17, 21, 27, 38, 42]
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    masked_without_documents = _output_and_grads(layer, x, None)[0]
    assert packed == bool((masked_without_documents - want[0]).abs().max() > 1e-4)
