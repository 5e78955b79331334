"""Megatron's model variants without a Hugging Face twin, against direct computations:
--apply-layernorm-1p, --squared-relu, --rotary-interleaved, --position-embedding-type none and
the --attention-backend choices; and every new variant at TP=2 (with and without sequence
parallelism) against TP=1 within 1e-5 (logits, loss and every gradient)."""

import pytest
import torch
import torch.nn.functional as F

from megalite.model import attention_backends
from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.model.norms import LayerNorm, RMSNorm
from megalite.model.rope import apply_rotary_interleaved, rotary_cos_sin
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.model.test_gpt_tp import compare, make_config, run_model

VOCAB, SEQ = 250, 16


def tokens(seed=0):
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


def logits(config, *, edit=None, seed=0):
    model = GPTModel(config, init_seed=7).eval()
    if edit:
        with torch.no_grad():
            edit(model)
    with torch.no_grad():
        return model(tokens(seed))[..., :VOCAB]


@pytest.mark.parametrize("cls", [LayerNorm, RMSNorm])
def test_layernorm_1p_multiplies_by_one_plus_weight(cls):
    x = torch.randn(4, 3, 32)
    norm = cls(32, 1e-5, zero_centered=True)
    assert torch.equal(norm.weight, torch.zeros(32))  # gamma starts at 1
    with torch.no_grad():
        norm.weight.uniform_(-0.5, 0.5)
    gamma = 1 + norm.weight.detach()
    if cls is LayerNorm:
        with torch.no_grad():
            norm.bias.uniform_(-0.5, 0.5)
        expected = F.layer_norm(x, (32,), gamma, norm.bias.detach(), 1e-5)
    else:
        expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * gamma
    torch.testing.assert_close(norm(x), expected, rtol=1e-6, atol=1e-6)


def test_layernorm_1p_model_equals_plain_model_with_weights_plus_one():
    config = make_config("llama", qk_layernorm=True)

    def perturb(model):
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.linspace(-0.3, 0.3, p.numel()).reshape(p.shape))

    def plus_one(model):
        perturb(model)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1)

    ours = logits(config.replace(apply_layernorm_1p=True), edit=perturb)
    torch.testing.assert_close(ours, logits(config, edit=plus_one), rtol=1e-5, atol=1e-5)
    assert (ours - logits(config, edit=perturb)).abs().max() > 1e-2


def test_squared_relu_mlp_is_relu_squared():
    config = make_config("gpt2", activation="squared_relu")
    mlp = GPTModel(config, init_seed=7).layers["0"].mlp
    x = torch.randn(SEQ, 2, config.hidden_size)
    fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
    expected = F.linear(F.relu(F.linear(x, fc1.weight, fc1.bias)).square(), fc2.weight, fc2.bias)
    y, bias = mlp(x)  # in a layer the output projection hands its bias to the bias-dropout-add
    torch.testing.assert_close(y + bias, expected, rtol=1e-5, atol=1e-6)


def test_interleaved_rope_rotates_adjacent_pairs():
    s, b, n, d, rot = 6, 2, 3, 16, 12
    x = torch.randn(s, b, n, d)
    cos, sin = rotary_cos_sin(s, rot, 100.0, interleaved=True)
    ours = apply_rotary_interleaved(x, cos, sin)
    # As complex numbers: pair (x[2i], x[2i+1]) times exp(i * position * freq_i).
    freqs = torch.outer(torch.arange(s).float(), 1.0 / 100.0 ** (torch.arange(0, rot, 2).float() / rot))
    pairs = torch.view_as_complex(x[..., :rot].reshape(s, b, n, rot // 2, 2).contiguous())
    expected = torch.view_as_real(pairs * torch.polar(torch.ones_like(freqs), freqs)[:, None, None]).flatten(-2)
    torch.testing.assert_close(ours[..., :rot], expected, rtol=1e-5, atol=1e-6)
    assert torch.equal(ours[..., rot:], x[..., rot:])
    base = make_config("llama")
    assert (logits(base.replace(rotary_interleaved=True)) - logits(base)).abs().max() > 1e-3


def test_no_position_embedding_has_no_position_table_and_is_position_blind_across_batches():
    config = make_config("gpt2", position_embedding_type="none")
    model = GPTModel(config, init_seed=7).eval()
    assert model.embedding.position_embeddings is None and model._rotary(SEQ, "cpu") is None
    t = tokens()
    same = torch.full_like(t, 5)  # a constant sequence: without positions, every row of layer 0's input is equal
    with torch.no_grad():
        first = model.embedding(same)
    assert torch.equal(first[0], first[-1])
    assert (logits(config) - logits(make_config("gpt2"))).abs().max() > 1e-3


@pytest.mark.parametrize("backend", ["flash", "fused", "unfused", "local"])
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_attention_backends_match_auto(backend, family, monkeypatch):
    calls = []
    explicit, kernel = attention_backends.explicit_attention, attention_backends.sdpa_kernel
    monkeypatch.setattr(attention_backends, "explicit_attention",
                        lambda *a, **k: calls.append("explicit") or explicit(*a, **k))
    monkeypatch.setattr(attention_backends, "sdpa_kernel",
                        lambda kernels, **kw: calls.append(kernels) or kernel(kernels, **kw))
    config = make_config(family)
    ours = logits(config.replace(attention_backend=backend))
    torch.testing.assert_close(ours, logits(config), rtol=1e-5, atol=1e-5)
    expected = "explicit" if backend in ("unfused", "local") else [torch.nn.attention.SDPBackend.FLASH_ATTENTION]
    assert calls and all(c == expected for c in calls)  # CPU: fused is served by the CPU flash kernel


def test_explicit_attention_matches_sdpa_with_mask_and_groups():
    q, k, v = torch.randn(2, 4, 8, 16), torch.randn(2, 2, 8, 16), torch.randn(2, 2, 8, 16)
    mask = torch.rand(2, 1, 8, 8) > 0.3
    mask[..., 0] = True
    for m in (None, mask):
        ours = attention_backends.explicit_attention(q, k, v, m, dropout=0.0, scale=0.25)
        ref = F.scaled_dot_product_attention(q, k, v, attn_mask=m, is_causal=m is None, scale=0.25, enable_gqa=True)
        torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-6)


FEATURES = {
    "llama-rope-variants": ("llama", dict(qk_layernorm=True, apply_layernorm_1p=True, rotary_interleaved=True,
                                          use_rope_scaling=True, rope_scaling_factor=4.0, rotary_base=1e6,
                                          attention_backend="unfused")),
    "llama-interpolation": ("llama", dict(rotary_seq_len_interpolation_factor=4.0, qk_layernorm=True,
                                          attention_backend="local", rotary_percent=0.5)),
    # (LayerNorm qk-norm is left out here: its key bias has an exactly-zero gradient, as a
    # constant added to every key shifts each score row equally, so only rounding noise is left.)
    "gpt2-nope-squared-relu": ("gpt2", dict(position_embedding_type="none", activation="squared_relu",
                                            apply_layernorm_1p=True)),
}


def _tp_worker(rank, world_size):
    state = ParallelState.create(ParallelLayout(world_size, tensor=2))
    out = {}
    for name, (family, features) in FEATURES.items():
        for sp in (False, True):
            result = run_model(make_config(family, sequence_parallel=sp, **features), state)
            out[(name, sp)] = result
    return out


def test_new_features_tp2_match_tp1():
    result = run_distributed(_tp_worker, 2)[0]
    for name, (family, features) in FEATURES.items():
        reference = run_model(make_config(family, **features), ParallelState.single())
        assert features.get("qk_layernorm", False) == any("q_layernorm" in n for n in reference["grads"])
        for sp in (False, True):
            compare(result[(name, sp)], reference, f"{name} sp={sp}")


def test_cuda_flash_backend_restricts_sdpa_to_its_kernel(monkeypatch):
    """The CUDA path without a GPU: fake CUDA tensors through core_attention (auto and fused:
    tests/model/test_attention_kernels.py)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    calls = []
    kernel = attention_backends.sdpa_kernel
    monkeypatch.setattr(attention_backends, "sdpa_kernel", lambda ks, **kw: calls.append(ks) or kernel(ks, **kw))
    with FakeTensorMode():
        q, k, v = (torch.empty(2, heads, 8, 16, device="cuda", dtype=torch.bfloat16) for heads in (4, 2, 2))
        out = attention_backends.core_attention(q, k, v, None, backend="flash", dropout=0.0, scale=0.25)
    assert out.shape == q.shape and calls == [[torch.nn.attention.SDPBackend.FLASH_ATTENTION]]
