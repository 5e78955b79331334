"""Model FLOPs, MFU and activation memory, counted as shared/docs/formulas.md says.

    F_token = 6 * P_mm + 12 * L * s * h
    P_mm    = L * (h*q + 2*h*d_kv + q*h + k*h*f) + h*V     (q = a * head_dim, = h usually;
                                                             k = 2 GeLU, 3 SwiGLU)
    MoE layers: k*h*f becomes h*E + topk*k*h*f_moe (+ k*h*f_shared + h): activated experts only
    MFU     = F_token * tokens/s per GPU / peak FLOP/s

Attention is counted non-causally and recompute is not counted (Megatron 2022, PaLM). Bytes
of parameters, gradients and optimizer state per parameter are in megalite.optimizer.memory_report.
"""

import re

from megalite.model.config import GPTConfig

# Dense bf16 peak FLOP/s (formulas.md). Patterns match torch.cuda.get_device_name(); anything
# else (H100/H200 PCIe or NVL, GH200, consumer cards) is unknown and gets no MFU, not a guess.
PEAK_BF16_FLOPS = (
    (re.compile(r"\bH100\b.*\b(SXM|HBM3)"), "H100 SXM", 989.4e12),
    (re.compile(r"\bH200\b(?!.*NVL)"), "H200", 989.4e12),
    (re.compile(r"\bA100\b"), "A100", 312e12),
)

def mlp_matmul_parameters(config: GPTConfig, layer: int, activated: bool = True) -> int:
    """MLP weights of one layer that multiply each token: the dense MLP's; in an MoE layer the
    router's (h * E), top-k experts' (every expert's with activated=False) and the shared
    expert's (and its gate)."""
    h, k = config.hidden_size, 3 if config.activation == "swiglu" else 2
    moe = config.moe
    if moe is None or not moe.is_moe_layer(layer, config.num_layers):
        return k * h * config.ffn_hidden_size
    experts = moe.router_topk if activated else moe.num_experts
    shared = k * h * moe.shared_expert_intermediate_size + h * moe.shared_expert_gate \
        if moe.shared_expert_intermediate_size else 0
    return h * moe.num_experts + experts * k * h * moe.ffn_hidden_size + shared


def matmul_parameters(config: GPTConfig, padded_vocab_size: int, activated: bool = True) -> int:
    """P_mm: weights that take part in matrix multiplies (QKV, attention output, MLP, output
    layer); biases, norms and the embedding lookup are left out. In MoE layers only the
    activated (top-k) experts count, unless activated=False (every expert's parameters)."""
    h = config.hidden_size
    q = config.num_attention_heads * config.kv_channels
    d_kv = config.num_query_groups * config.kv_channels
    attention = h * q + 2 * h * d_kv + q * h
    return sum(attention + mlp_matmul_parameters(config, i, activated) for i in range(config.num_layers)) \
        + h * padded_vocab_size


def flops_per_token(config: GPTConfig, seq_length: int, padded_vocab_size: int) -> int:
    """Training FLOPs per token (forward + backward): 6 P_mm + 12 L s h."""
    attention = 12 * config.num_layers * seq_length * config.hidden_size
    return 6 * matmul_parameters(config, padded_vocab_size) + attention


def peak_flops(device_name: str | None = None) -> tuple[str, float] | None:
    """(name, dense bf16 peak FLOP/s) of a GPU, by default the current CUDA device; None when
    there is no CUDA device or the device is not in the table."""
    if device_name is None:
        import torch

        if not torch.cuda.is_available():
            return None
        device_name = torch.cuda.get_device_name()
    for pattern, name, peak in PEAK_BF16_FLOPS:
        if pattern.search(device_name):
            return name, peak
    return None


def model_flops_utilization(flops_per_token: float, tokens_per_second_per_gpu: float,
                            peak: float | None) -> float | None:
    """MFU as a fraction (0.4 = 40%), or None when the peak is unknown."""
    if peak is None:
        return None
    return flops_per_token * tokens_per_second_per_gpu / peak


def activation_bytes_per_layer(seq_length: int, micro_batch_size: int, hidden_size: int,
                               num_attention_heads: int, tensor_parallel: int = 1,
                               sequence_parallel: bool = False, recompute: str | None = None,
                               flash_attention: bool = False) -> float:
    """Activation bytes one transformer layer keeps for backward with 16-bit activations
    (Korthikanti et al. 2022; formulas.md). `recompute` is None, 'selective' or 'full'; a
    flash-attention kernel stores no s x s scores."""
    s, b, h, a, t = seq_length, micro_batch_size, hidden_size, num_attention_heads, tensor_parallel
    if recompute == "full":
        return 2.0 * s * b * h
    scores = 0.0 if (recompute == "selective" or flash_attention) else 5.0 * a * s / (h * t)
    if sequence_parallel:
        return s * b * h * (34.0 / t + scores)
    return s * b * h * (10.0 + 24.0 / t + scores)
