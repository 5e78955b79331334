"""FLOPs and activation memory of multi-latent attention and multi-token prediction
(megalite/dryrun/README.md, "FLOPs and memory of MLA and MTP"): P_mm equals the matmul weights
the model builds (each MTP depth using the output layer once more); DeepSeek-V3's shape gives its
published 671B total and 37B activated parameters; the activation formula's MLA terms by hand."""

import math

import pytest

from megalite.checkpoint.hf.mapping import config_from_hf
from megalite.model.gpt import GPTModel
from megalite.model.mla_config import MLAConfig
from megalite.training.flops import (activation_bytes_per_layer, attention_score_flops, flops_per_token,
                                     matmul_parameters, mtp_activation_bytes)
from tests.parallel.mla_harness import mla_config


def _matmul_weights(model):
    return sum(p.numel() for name, p in model.named_parameters() if p.ndim == 2 and "word_embeddings" not in name)


def test_matmul_parameters_are_the_models_weight_matrices():
    config = mla_config()
    model = GPTModel(config)
    vocab, h = model.padded_vocab, config.hidden_size
    assert matmul_parameters(config, vocab, activated=False) == _matmul_weights(model) + 2 * h * vocab
    no_query_latent = config.replace(mla={**config.mla.to_dict(), "q_lora_rank": None}, mtp_num_layers=None, moe=None)
    assert matmul_parameters(no_query_latent, vocab) == _matmul_weights(GPTModel(no_query_latent))


def test_flops_per_token_by_hand():
    config = mla_config(moe=None, mtp_num_layers=None)  # 4 layers, h 16, 4 heads, d_q 8, d_v 6
    mla, s, vocab = config.mla, 8, 128
    # q down + q up + kv down (latent and rotary key) + kv up + output projection
    attention = 16 * 12 + 12 * 4 * 8 + 16 * (8 + 4) + 8 * 4 * (4 + 6) + 4 * 6 * 16
    mlp = 3 * 16 * 24
    assert matmul_parameters(config, vocab) == 4 * (attention + mlp) + 16 * vocab
    assert attention_score_flops(config, s) == 6 * s * 4 * (mla.q_head_dim + mla.v_head_dim)
    assert flops_per_token(config, s, vocab) == 6 * matmul_parameters(config, vocab) + 4 * 6 * s * 4 * 14
    with_mtp = config.replace(mtp_num_layers=2)
    depth = attention + mlp + 2 * 16 * 16 + 16 * vocab
    assert flops_per_token(with_mtp, s, vocab) == flops_per_token(config, s, vocab) + 2 * (6 * depth + 6 * s * 4 * 14)


def test_deepseek_v3_counts_671b_parameters_37b_activated():
    """DeepSeek-V3's report: 671B parameters, 37B activated per token (MTP module not counted)."""
    transformers = pytest.importorskip("transformers")
    config = config_from_hf(transformers.DeepseekV3Config().to_dict()).replace(mtp_num_layers=None)
    vocab = config.padded_vocab_size(1)
    embedding = vocab * config.hidden_size
    assert math.isclose(matmul_parameters(config, vocab, activated=False) + embedding, 671.0e9, rel_tol=2e-3)
    assert math.isclose(matmul_parameters(config, vocab) + embedding, 37.5e9, rel_tol=0.02)


def test_activation_bytes_of_an_mla_layer():
    s, b, h, a, t = 4096, 1, 7168, 128, 2
    mla = MLAConfig(q_lora_rank=1536, kv_lora_rank=512, qk_head_dim=128, qk_pos_emb_head_dim=64, v_head_dim=128)
    attention = 4 * a * (192 + 128)  # Q, K, V and the output projection's input, bytes per token
    latents = 4 * (1536 + 512)  # each latent's norm input and up-projection input
    assert activation_bytes_per_layer(s, b, h, a, t, mla=mla, flash_attention=True) == \
        pytest.approx(s * b * (10 * h + latents + (16 * h + attention) / t), rel=1e-12)
    assert activation_bytes_per_layer(s, b, h, a, t, sequence_parallel=True, mla=mla, flash_attention=True) == \
        pytest.approx(s * b * (26 * h + attention + latents) / t, rel=1e-12)
    assert activation_bytes_per_layer(s, b, h, a, t, mla=mla, latent_norms=False, flash_attention=True) == \
        pytest.approx(s * b * (10 * h + latents / 2 + (16 * h + attention) / t), rel=1e-12)
    scores = activation_bytes_per_layer(s, b, h, a, t, mla=mla) - activation_bytes_per_layer(s, b, h, a, t, mla=mla,
                                                                                             flash_attention=True)
    assert scores == pytest.approx(5 * a * s * s * b / t, rel=1e-12)  # as standard attention's
    assert activation_bytes_per_layer(s, b, h, a, t, recompute="full", mla=mla) == 2 * s * b * h
    assert mtp_activation_bytes(s, b, h, t, sequence_parallel=True) == 10 * s * b * h / t
