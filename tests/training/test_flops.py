"""FLOPs per token, MFU, device peaks and memory per parameter against formulas.md."""

import pytest

from megalite.model.config import GPTConfig
from megalite.optimizer.memory_report import bytes_per_parameter, fsdp_bytes_per_parameter
from megalite.training.flops import (activation_bytes_per_layer, flops_per_token, matmul_parameters,
                                     model_flops_utilization, peak_flops, run_peak_flops)


def megatron_flops_per_step(batch, seq, layers, hidden, vocab):
    """Megatron's 2021 count: 72 B s L h^2 (1 + s / 6h + V / 12hL)."""
    return 72 * batch * seq * layers * hidden**2 * (
        1 + seq / (6 * hidden) + vocab / (12 * hidden * layers))


@pytest.mark.parametrize("layers, hidden, heads, seq, vocab", [
    (12, 768, 12, 1024, 50304),       # GPT-2 124M
    (24, 1024, 16, 1024, 50432),      # GPT-2 350M
    (48, 1600, 25, 2048, 50304),      # GPT-2 1.5B
])
def test_gpt2_style_equals_megatrons_formula(layers, hidden, heads, seq, vocab):
    config = GPTConfig(num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
                       vocab_size=vocab, activation="openai_gelu")
    batch = 512
    ours = flops_per_token(config, seq, vocab) * batch * seq
    assert ours == pytest.approx(megatron_flops_per_step(batch, seq, layers, hidden, vocab), rel=1e-12)


def test_gqa_swiglu_by_hand():
    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                       vocab_size=200, ffn_hidden_size=128, activation="swiglu")
    # per layer: Q 64x64 + K,V 2 x 64x16 + proj 64x64 + SwiGLU 3 x 64x128; output layer 64 x 256
    per_layer = 64 * 64 + 2 * 64 * 16 + 64 * 64 + 3 * 64 * 128
    assert matmul_parameters(config, 256) == 2 * per_layer + 64 * 256 == 86016
    assert flops_per_token(config, 32, 256) == 6 * 86016 + 12 * 2 * 32 * 64


@pytest.mark.parametrize("tied", [True, False])
def test_matmul_parameters_match_the_models_weight_matrices(tied):
    from megalite.model.gpt import GPTModel

    config = GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=2,
                       vocab_size=200, ffn_hidden_size=96, activation="swiglu",
                       position_embedding_type="rope", add_bias_linear=False,
                       untie_embeddings_and_output_weights=not tied)
    model = GPTModel(config)
    padded = config.padded_vocab_size(1)
    matrices = sum(p.numel() for name, p in model.named_parameters()
                   if p.dim() == 2 and "embedding" not in name)
    assert matmul_parameters(config, padded) == matrices + (64 * padded if tied else 0)


def test_device_peaks_and_mfu():
    assert peak_flops("NVIDIA H100 80GB HBM3") == ("H100 SXM", 989.4e12)
    assert peak_flops("NVIDIA H100 SXM5 80GB") == ("H100 SXM", 989.4e12)
    assert peak_flops("NVIDIA H200") == ("H200", 989.4e12)
    assert peak_flops("NVIDIA A100-SXM4-80GB") == ("A100", 312e12)
    for unknown in ("NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA GH200 480GB", "NVIDIA H200 NVL",
                    "NVIDIA GeForce RTX 4090", "Tesla V100-SXM2-16GB"):
        assert peak_flops(unknown) is None, unknown
    assert model_flops_utilization(1e9, 400_000, 989.4e12) == pytest.approx(4e14 / 989.4e12, rel=1e-12)
    assert model_flops_utilization(1e9, 400_000, None) is None


def test_fp8_peaks_only_for_fp8_runs():
    """Dense FP8 peak = 2 x dense bf16 on H100 / H200 (data sheets); an FP8 run gets both, a
    16-bit run only the bf16 one; no FP8 peak on A100 or an unknown card."""
    for card in ("NVIDIA H100 80GB HBM3", "NVIDIA H200"):
        assert run_peak_flops(True, card) == (989.4e12, 1978.9e12)
        assert run_peak_flops(False, card) == (989.4e12, None)
    assert run_peak_flops(True, "NVIDIA A100-SXM4-80GB") == (312e12, None)
    assert run_peak_flops(True, "NVIDIA H100 PCIe") == (None, None)


def test_bytes_per_parameter_table():
    assert [bytes_per_parameter(p) for p in ("bf16", "fp16", "fp32")] == [18, 20, 16]
    assert bytes_per_parameter("bf16", True, 8) == 6 + 12 / 8
    assert bytes_per_parameter("fp16", True, 4) == 4 + 16 / 4
    assert bytes_per_parameter("fp32", True, 2) == 8 + 8 / 2
    assert bytes_per_parameter("bf16", True, 1) == 18        # d = 1: nothing to shard
    assert fsdp_bytes_per_parameter(8) == 2.0
    with pytest.raises(ValueError, match="precision"):
        bytes_per_parameter("int8")


def test_activation_memory_per_layer():
    s, b, h, a, t = 2048, 1, 4096, 32, 4
    sbh = s * b * h
    assert activation_bytes_per_layer(s, b, h, a) == sbh * (34 + 5 * a * s / h)
    assert activation_bytes_per_layer(s, b, h, a, t) == sbh * (10 + 24 / t + 5 * a * s / (h * t))
    assert activation_bytes_per_layer(s, b, h, a, t, sequence_parallel=True) == \
        sbh * (34 / t + 5 * a * s / (h * t))
    assert activation_bytes_per_layer(s, b, h, a, t, recompute="selective") == sbh * (10 + 24 / t)
    assert activation_bytes_per_layer(s, b, h, a, t, True, "selective") == 34 * sbh / t
    assert activation_bytes_per_layer(s, b, h, a, t, recompute="full") == 2 * sbh
    assert activation_bytes_per_layer(s, b, h, a, flash_attention=True) == 34 * sbh
