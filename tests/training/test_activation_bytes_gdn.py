"""Activation bytes of Gated DeltaNet layers (megalite/dryrun/README.md, "Activation memory of
Gated DeltaNet layers"): the mixer's per-token bytes against the storages autograd actually
saves in a bf16 forward of megalite's GatedDeltaNet (several head shapes, a padded last chunk,
one row); the layer's terms shared with attention layers under TP, SP and recompute; each layer
costed by its kind (--linear-attention-freq)."""

import pytest
import torch

from megalite.model.config import GPTConfig
from megalite.model.gated_delta_net import GatedDeltaNet
from megalite.model.gdn_config import GDNConfig
from megalite.training.flops import (activation_bytes_of_layer, activation_bytes_per_layer,
                                     gdn_activation_bytes_per_layer, gdn_mixer_bytes_per_token)

H = 32


def _gdn(dk=8, dv=8, nk=2, nv=4, chunk=16):
    return GDNConfig(linear_attention_freq=2, linear_key_head_dim=dk, linear_value_head_dim=dv,
                     linear_num_key_heads=nk, linear_num_value_heads=nv, chunk_size=chunk)


def _saved_bytes(gdn: GDNConfig, b: int, s: int) -> int:
    """Bytes of the distinct storages a bf16 GatedDeltaNet forward saves for backward (its
    parameters and input excluded)."""
    config = GPTConfig(num_layers=2, hidden_size=H, num_attention_heads=4, vocab_size=100, normalization="RMSNorm",
                       activation="swiglu", add_bias_linear=False, params_dtype="bfloat16", gdn=gdn.to_dict())
    layer = GatedDeltaNet(config)
    x = torch.randn(s, b, H, dtype=torch.bfloat16, requires_grad=True)
    own = {t.untyped_storage().data_ptr() for t in (x, *layer.parameters())}
    saved, held = {}, []

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in own:
            saved[storage.data_ptr()] = storage.nbytes()
            # held to the end: a saved storage freed mid-forward (its node dropped) would let a
            # later one reuse its address and replace its entry (seen once in a full-suite run)
            held.append(storage)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(x)
    return sum(saved.values())


@pytest.mark.parametrize("gdn, b, s", [
    (_gdn(), 2, 64),  # each key head serving two value heads
    (_gdn(dv=12, nv=2), 2, 64),  # as many value heads as key heads, d_v != d_k
    (_gdn(dk=16, nk=1, chunk=8), 3, 50),  # a padded last chunk
    (_gdn(dv=16, chunk=32), 1, 128),  # one row
], ids=["grouped", "ungrouped", "padded", "one-row"])
def test_mixer_bytes_are_what_autograd_saves(gdn, b, s):
    assert gdn_mixer_bytes_per_token(gdn, s) * b * s == pytest.approx(_saved_bytes(gdn, b, s), rel=0.01)


def test_layer_terms_under_tp_sp_and_recompute():
    gdn, s, b, h, t = _gdn(nk=4, nv=8), 256, 2, 64, 2
    per_rank = _gdn(nk=2, nv=4)  # TP splits the heads: a rank's mixer is the half-width one
    mixer = s * b * gdn_mixer_bytes_per_token(per_rank, s)
    assert gdn_mixer_bytes_per_token(gdn, s, t) == gdn_mixer_bytes_per_token(per_rank, s)
    assert gdn_activation_bytes_per_layer(s, b, h, gdn, t) == s * b * h * (10 + 16 / t) + mixer
    assert gdn_activation_bytes_per_layer(s, b, h, gdn, t, sequence_parallel=True) == s * b * h * 26 / t + mixer
    # the mixer recomputes nothing under selective (core_attn) recompute; full keeps the layer input
    assert gdn_activation_bytes_per_layer(s, b, h, gdn, t, recompute="selective") == \
        gdn_activation_bytes_per_layer(s, b, h, gdn, t)
    assert gdn_activation_bytes_per_layer(s, b, h, gdn, t, recompute="full") == 2 * s * b * h


def test_each_layer_costed_by_its_kind():
    config = GPTConfig(num_layers=4, hidden_size=H, num_attention_heads=4, vocab_size=100, gdn=_gdn().to_dict())
    s, b = 64, 2
    linear = gdn_activation_bytes_per_layer(s, b, H, config.gdn, 2, True)
    attention = activation_bytes_per_layer(s, b, H, 4, 2, True, flash_attention=True)
    got = [activation_bytes_of_layer(config, n, s, b, 2, True, flash_attention=True) for n in (0, 1, 2, 3, -1)]
    assert got == [linear, attention, linear, attention, attention]
    assert linear > 3 * attention  # the fp32 chunk matrices
