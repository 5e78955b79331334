"""Gated DeltaNet layers and the hybrid model on one process: the layer against transformers'
Qwen3NextGatedDeltaNet on the same weights, cached generation against the full forward,
packed documents against separate rows, gated attention, the layer pattern."""

import pytest
import torch

from megalite.inference.kv_cache import InferenceCache
from megalite.model.config import GPTConfig
from megalite.model.gated_delta_net import GatedDeltaNet
from megalite.model.gdn_config import GDNConfig
from megalite.model.gpt import GPTModel

GDN = dict(linear_attention_freq=2, linear_key_head_dim=8, linear_value_head_dim=4, linear_num_key_heads=2,
           linear_num_value_heads=4, chunk_size=4)


def hybrid_config(**changes):
    values = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
                  position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                  add_bias_linear=False, attention_dropout=0.0, hidden_dropout=0.0, attention_output_gate=True,
                  gdn=dict(GDN), moe=dict(num_experts=4, router_topk=2, ffn_hidden_size=16))
    values.update(changes)
    return GPTConfig(**values)


def seeded_layer(config):
    """A GatedDeltaNet of `config` with seeded N(0, 0.09) weights and decays in (0, 1), and the
    generator, to draw the inputs from."""
    layer = GatedDeltaNet(config)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
        layer.A_log.copy_(torch.rand(layer.A_log.shape, generator=gen).log())
    return layer, gen

def test_layer_pattern_as_megatron():
    assert GDNConfig(linear_attention_freq=3).layer_pattern(6) == (1, 1, 0, 1, 1, 0)
    assert GDNConfig(linear_attention_freq=(0, 1, 1)).layer_pattern(3) == (0, 1, 1)
    with pytest.raises(ValueError, match="3 entries for 4 layers"):
        GDNConfig(linear_attention_freq=(0, 1, 1)).layer_pattern(4)
    model = GPTModel(hybrid_config())
    kinds = [type(layer.self_attention).__name__ for layer in model.layers.values()]
    assert kinds == ["GatedDeltaNet", "SelfAttention", "GatedDeltaNet", "SelfAttention"]


def test_layer_equals_transformers_qwen3_next():
    """Megatron's in_proj blocks [q, k, v, z, b, a] regrouped into transformers' per-key-head
    in_proj_qkvz / in_proj_ba; conv1d, A_log, dt_bias, the gated norm and out_proj as they are."""
    modeling = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")
    from transformers import Qwen3NextConfig
    config = hybrid_config()
    layer, gen = seeded_layer(config)
    hf_config = Qwen3NextConfig(hidden_size=32, linear_num_key_heads=2, linear_num_value_heads=4,
                                linear_key_head_dim=8, linear_value_head_dim=4, linear_conv_kernel_dim=4,
                                hidden_act="silu", rms_norm_eps=config.norm_epsilon)
    hf = modeling.Qwen3NextGatedDeltaNet(hf_config, layer_idx=0)
    nk, r = 2, 2  # key heads, value heads per key head
    q, k, v, z, b, a = layer.in_proj.weight.split(GDNConfig(**GDN).in_proj_sections())
    per_group = [t.reshape(nk, -1, 32) for t in (q, k, v, z)]
    with torch.no_grad():
        hf.in_proj_qkvz.weight.copy_(torch.cat(per_group, dim=1).reshape(-1, 32))
        hf.in_proj_ba.weight.copy_(torch.cat([b.reshape(nk, r, 32), a.reshape(nk, r, 32)], dim=1).reshape(-1, 32))
        hf.conv1d.weight.copy_(layer.conv1d.weight)
        hf.A_log.copy_(layer.A_log)
        hf.dt_bias.copy_(layer.dt_bias)
        hf.norm.weight.copy_(layer.out_norm.weight)
        hf.out_proj.weight.copy_(layer.out_proj.weight)
    x = torch.randn(2, 9, 32, generator=gen)
    want = hf(x)
    got = layer(x.transpose(0, 1)).transpose(0, 1)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cached_generation_equals_full_forward():
    model = GPTModel(hybrid_config()).eval()
    tokens = torch.randint(0, 100, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = InferenceCache(11)
        pieces = [model(tokens[:, :6], inference_cache=cache)]
        cache.advance(6)
        for i in range(6, 11):
            pieces.append(model(tokens[:, i:i + 1], inference_cache=cache))
            cache.advance(1)
    torch.testing.assert_close(torch.cat(pieces, dim=1), full, atol=1e-5, rtol=1e-5)


def _document_mask(starts, s):
    """Megatron's mask (True = not allowed) for documents beginning at `starts`."""
    doc = torch.zeros(s, dtype=torch.long)
    for start in starts:
        doc[start:] += 1
    same = doc[:, None] == doc[None, :]
    return ~(same & torch.ones(s, s, dtype=torch.bool).tril())


def test_packed_documents_equal_separate_rows():
    """Two documents in one row (conv taps and the state reset at the boundary) give the
    losses of the two documents run alone; without the mask the second differs."""
    model = GPTModel(hybrid_config(position_embedding_type="none", moe=None))
    tokens = torch.randint(0, 100, (1, 13), generator=torch.Generator().manual_seed(1))
    packed = model(tokens, labels=tokens, attention_mask=_document_mask([7], 13)[None, None])
    first = model(tokens[:, :7], labels=tokens[:, :7])
    second = model(tokens[:, 7:], labels=tokens[:, 7:])
    torch.testing.assert_close(packed, torch.cat((first, second), dim=1), atol=1e-5, rtol=1e-5)
    unmasked = model(tokens, labels=tokens)
    assert (unmasked[:, 7:] - second).abs().max() > 1e-4


def test_attention_output_gate_multiplies_by_sigmoid_of_the_gate_heads():
    config = hybrid_config(gdn=None, moe=None, num_layers=1)
    attention = GPTModel(config).layers["0"].self_attention
    ungated = GPTModel(config.replace(attention_output_gate=False)).layers["0"].self_attention
    n, d = 2, 8  # q heads per group, head width
    w = attention.linear_qkv.weight.view(2, 2 * n + 2, d, 32)
    with torch.no_grad():
        ungated.linear_qkv.weight.copy_(torch.cat((w[:, :n], w[:, 2 * n:]), dim=1).reshape(-1, 32))
        ungated.linear_proj.weight.copy_(attention.linear_proj.weight)
    x = torch.randn(5, 2, 32, generator=torch.Generator().manual_seed(2))
    captured = {}
    attention.linear_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("gated", i[0]))
    ungated.linear_proj.register_forward_hook(lambda m, i, o: captured.__setitem__("plain", i[0]))
    attention(x), ungated(x)
    gate = torch.nn.functional.linear(x, w[:, n:2 * n].reshape(-1, 32)).view(5, 2, 2, n, d).reshape(5, 2, -1)
    torch.testing.assert_close(captured["gated"], captured["plain"] * torch.sigmoid(gate))


def test_bad_shapes_refused():
    with pytest.raises(ValueError, match="multiple of linear_num_key_heads"):
        GDNConfig(linear_num_key_heads=3, linear_num_value_heads=4)
    with pytest.raises(ValueError, match="linear_attention_freq"):
        GDNConfig(linear_attention_freq=(0, 2))


def test_unequal_blocks_shard_and_reassemble():
    """partition_stride as a tuple of block sizes: each block split over the ranks on its own,
    reassembled exactly, and DCP's chunk table naming the same rows."""
    from megalite.checkpoint.dcp.format import tp_chunks
    from megalite.parallel.sharding import full_from_shards, shard_of_full
    full = torch.arange(14.0).view(14, 1)
    blocks = (4, 4, 2, 2, 2)
    shards = [shard_of_full(full, 0, blocks, r, 2) for r in range(2)]
    assert shards[1].flatten().tolist() == [2, 3, 6, 7, 9, 11, 13]
    assert torch.equal(full_from_shards(shards, 0, blocks), full)
    rows = [[int(full[o[0]:o[0] + z[0]].flatten()[i]) for o, z, _ in chunks for i in range(z[0])]
            for chunks in tp_chunks((14, 1), 0, blocks, 2)]
    assert rows[1] == [2, 3, 6, 7, 9, 11, 13]
    assert [local for _, _, local in tp_chunks((14, 1), 0, blocks, 2)[1]] == [0, 2, 4, 5, 6]


def test_full_recompute_gives_the_same_gradients():
    config = hybrid_config(moe=None)
    tokens = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    grads = []
    for cfg in (config, config.replace(recompute_granularity="full")):
        model = GPTModel(cfg)
        model(tokens, labels=tokens).mean().backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
    for name, grad in grads[0].items():
        torch.testing.assert_close(grads[1][name], grad, atol=1e-6, rtol=1e-6)


def test_hugging_face_export_refused_in_one_line():
    from megalite.checkpoint.hf.mapping import family_of
    for config in (hybrid_config(moe=None), hybrid_config(moe=None, gdn=None)):
        with pytest.raises(ValueError, match="Qwen3-Next") as info:
            family_of(config)
        assert "\n" not in str(info.value)


def test_generation_with_the_state_equals_recomputing_and_config_round_trips():
    from megalite.inference.generate import generate_tokens, inference_config
    config = hybrid_config()
    again = inference_config(config.to_dict())
    assert again.gdn == config.gdn and again.attention_output_gate
    model = GPTModel(again).eval()
    prompt = [3, 14, 15, 92, 65]
    assert generate_tokens(model, prompt, 6) == generate_tokens(model, prompt, 6, use_cache=False)
