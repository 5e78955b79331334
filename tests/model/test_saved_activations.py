"""What a transformer layer keeps for backward: q, k and v, never the whole fused QKV
projection output that a view of v (or k) would keep alive. With rotary embeddings or grouped
queries q and k become new tensors, and a saved view of v held the whole output: 3·s·b·h bytes
per Llama-3 8B layer instead of v's 0.5 (Korthikanti et al.'s 34·s·b·h budget counts v only)."""

import torch

from megalite.model.attention import _without_partial_views
from megalite.model.config import GPTConfig
from megalite.model.rope import rotary_cos_sin_for
from megalite.model.transformer import TransformerLayer

S, B = 16, 2


def _saved_storage_sizes(config, rotary: bool) -> list[int]:
    layer = TransformerLayer(config, 0)
    params = {p.untyped_storage()._cdata for p in layer.parameters()}
    x = torch.randn(S, B, config.hidden_size, requires_grad=True)
    sizes = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage._cdata not in params:
            sizes[storage._cdata] = storage.nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x, rotary_cos_sin_for(config, S, "cpu") if rotary else None)
    return list(sizes.values())


def test_rotary_layer_does_not_keep_the_fused_qkv_output():
    config = GPTConfig(num_layers=1, hidden_size=64, num_attention_heads=8, num_query_groups=8, ffn_hidden_size=80,
                       activation="swiglu", normalization="RMSNorm", position_embedding_type="rope",
                       add_bias_linear=False, vocab_size=128, max_position_embeddings=S, fused_kernels=True)
    qkv_bytes = 4 * S * B * 3 * 64
    sizes = _saved_storage_sizes(config, rotary=True)
    assert qkv_bytes not in sizes, sizes


def test_views_are_kept_when_q_k_and_v_all_view_the_output():
    qkv = torch.randn(4, 2, 3, 3, 5)[:, :, :, :, :]
    parts = (qkv[:, :, :, 0], qkv[:, :, :, 1], qkv[:, :, :, 2])
    assert all(a is b for a, b in zip(_without_partial_views(qkv, *parts), parts))
    rotated = (parts[0] * 2, parts[1] * 2, parts[2])
    q, k, v = _without_partial_views(qkv, *rotated)
    assert q is rotated[0] and k is rotated[1] and v._base is None and torch.equal(v, parts[2])
