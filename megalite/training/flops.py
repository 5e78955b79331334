"""Model FLOPs, MFU and activation memory, counted as shared/docs/formulas.md says.

    F_token = 6 * P_mm + 12 * L * s * h
    P_mm    = L * (h*q + 2*h*d_kv + q*h + k*h*f) + h*V     (q = a * head_dim, = h usually;
                                                             k = 2 GeLU, 3 SwiGLU)
    MoE layers: k*h*f becomes h*E + topk*k*h*f_moe (+ k*h*f_shared + h): activated experts only
    MFU     = F_token * tokens/s per GPU / peak FLOP/s
    (an --fp8-format run: against the dense bf16 peak, and also against the dense FP8 peak;
     F_token is the same count either way)

Multi-latent attention (megalite/dryrun/README.md, "FLOPs and memory of MLA and MTP"): a layer's
attention weights are h*r_q + r_q*a*d_q (or h*a*d_q without a query latent) + h*(r_kv + d_r)
+ r_kv*a*(d_c + d_v) + a*d_v*h, with d_c the per-head query/key width without rotation, d_r the rotary one,
d_q = d_c + d_r; its scores and context cost 6*s*a*(d_q + d_v) per token and layer instead of
12*s*h. Multi-token prediction adds per depth one layer, eh_proj (2*h*h) and the output layer
(h*V) to P_mm, and the layer's attention term.

Gated DeltaNet layers (--experimental-attention-variant gdn; megalite/model/README.md): their
attention weights are in_proj's h*(2*n_k*d_k + 2*n_v*d_v + 2*n_v) and out_proj's n_v*d_v*h; in
place of 12*s*h they cost, per token, 6*K*(2*n_k*d_k + n_v*d_v) (the depthwise convolution) and
6*n_v*(3*d_k*d_v + C*(3*d_k + 2*d_v)) (the chunked delta rule's matrix products with chunks of C
tokens: q and beta-weighted k against the chunk's initial state and the state update, q k^T and
k k^T, the scores and the triangular inverse times the values) -- linear in s.
Their activation bytes per layer: gdn_activation_bytes_per_layer (megalite/dryrun/README.md,
"Activation memory of Gated DeltaNet layers").

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
# Dense FP8 tensor-core peak FLOP/s (NVIDIA's H100 / H200 SXM data sheets: 3958 TFLOP/s with
# sparsity, half of it dense; twice the bf16 rate). A100 has no FP8 tensor cores.
PEAK_FP8_FLOPS = {"H100 SXM": 1978.9e12, "H200": 1978.9e12}

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


def _is_linear(config: GPTConfig, layer: int) -> bool:
    return config.gdn is not None and config.gdn.is_linear_layer(layer, config.num_layers)


def attention_matmul_parameters(config: GPTConfig, layer: int = -1) -> int:
    """Layer `layer`'s attention weights that multiply each token (QKV and output projections;
    with multi-latent attention the down and up projections; a Gated DeltaNet layer's in_proj and
    out_proj). `layer` -1: a full-attention layer."""
    h, a, mla = config.hidden_size, config.num_attention_heads, config.mla
    if layer >= 0 and _is_linear(config, layer):
        gdn = config.gdn
        return h * (sum(gdn.in_proj_sections())) + gdn.v_dim * h
    if mla is not None:
        q = h * a * mla.q_head_dim if mla.q_lora_rank is None else mla.q_lora_rank * (h + a * mla.q_head_dim)
        kv = h * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim) + mla.kv_lora_rank * a * (mla.qk_head_dim + mla.v_head_dim)
        return q + kv + a * mla.v_head_dim * h
    q = a * config.kv_channels
    d_kv = config.num_query_groups * config.kv_channels
    return h * q * (2 if config.attention_output_gate else 1) + 2 * h * d_kv + q * h


def attention_score_flops(config: GPTConfig, seq_length: int, layer: int = -1) -> int:
    """Training FLOPs per token of one layer's q k^T and probabilities x v (non-causal): 12 s h,
    or 6 s a (d_q + d_v) with multi-latent attention; a Gated DeltaNet layer's convolution and
    chunked delta rule (the module docstring)."""
    mla = config.mla
    if layer >= 0 and _is_linear(config, layer):
        gdn = config.gdn
        dk, dv, c = gdn.linear_key_head_dim, gdn.linear_value_head_dim, gdn.chunk_size
        conv = 6 * gdn.linear_conv_kernel_dim * (2 * gdn.qk_dim + gdn.v_dim)
        return conv + 6 * gdn.linear_num_value_heads * (3 * dk * dv + c * (3 * dk + 2 * dv))
    if mla is None:
        return 12 * seq_length * config.hidden_size
    return 6 * seq_length * config.num_attention_heads * (mla.q_head_dim + mla.v_head_dim)


def matmul_parameters(config: GPTConfig, padded_vocab_size: int, activated: bool = True) -> int:
    """P_mm: weights that take part in matrix multiplies (QKV, attention output, MLP, output
    layer; each MTP depth's layer, eh_proj and output layer again); biases, norms and the
    embedding lookup are left out. In MoE layers only the activated (top-k) experts count,
    unless activated=False (every expert's parameters)."""
    h, depths = config.hidden_size, config.mtp_num_layers or 0
    layers = range(config.num_layers + depths)  # MTP layers numbered after the decoder's
    return sum(attention_matmul_parameters(config, i) + mlp_matmul_parameters(config, i, activated) for i in layers) \
        + depths * 2 * h * h + (1 + depths) * h * padded_vocab_size


def flops_per_token(config: GPTConfig, seq_length: int, padded_vocab_size: int) -> int:
    """Training FLOPs per token (forward + backward): 6 P_mm + 12 L s h (see the module
    docstring for multi-latent attention and MTP)."""
    layers = range(config.num_layers + (config.mtp_num_layers or 0))
    return 6 * matmul_parameters(config, padded_vocab_size) + sum(attention_score_flops(config, seq_length, i)
                                                                  for i in layers)


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


def fp8_peak_flops(device_name: str | None = None) -> float | None:
    """Dense FP8 peak FLOP/s of a GPU (default the current CUDA device); None when unknown."""
    known = peak_flops(device_name)
    return PEAK_FP8_FLOPS.get(known[0]) if known else None


def run_peak_flops(fp8_run: bool, device_name: str | None = None) -> tuple[float | None, float | None]:
    """(dense bf16 peak, dense FP8 peak) a run's MFU is stated against: the FP8 one for
    --fp8-format runs only (a 16-bit run's log line keeps one MFU); None where unknown."""
    known = peak_flops(device_name)
    return (known[1] if known else None), (fp8_peak_flops(device_name) if fp8_run else None)


def model_flops_utilization(flops_per_token: float, tokens_per_second_per_gpu: float,
                            peak: float | None) -> float | None:
    """MFU as a fraction (0.4 = 40%), or None when the peak is unknown."""
    if peak is None:
        return None
    return flops_per_token * tokens_per_second_per_gpu / peak


def activation_bytes_per_layer(seq_length: int, micro_batch_size: int, hidden_size: int,
                               num_attention_heads: int, tensor_parallel: int = 1,
                               sequence_parallel: bool = False, recompute: str | None = None,
                               flash_attention: bool = False, mla=None, latent_norms: bool = True) -> float:
    """Activation bytes one transformer layer keeps for backward with 16-bit activations
    (Korthikanti et al. 2022; formulas.md). `recompute` is None, 'selective' or 'full'; a
    flash-attention kernel stores no s x s scores.

    With multi-latent attention (`mla`, an MLAConfig) the 8h per token of Q, K, V and the
    output projection's input become 4*a*(d_q + d_v), and each replicated latent adds its up
    projection's input, 2*r bytes, and its norm's input (`latent_norms`), 2*r more."""
    s, b, h, a, t = seq_length, micro_batch_size, hidden_size, num_attention_heads, tensor_parallel
    if recompute == "full":
        return 2.0 * s * b * h
    scores = 0.0 if (recompute == "selective" or flash_attention) else 5.0 * a * s / (h * t)
    attention, latents = 8.0, 0.0  # per h
    if mla is not None:
        attention = 4.0 * a * (mla.q_head_dim + mla.v_head_dim) / h
        latents = (4.0 if latent_norms else 2.0) * ((mla.q_lora_rank or 0) + mla.kv_lora_rank) / h
    if sequence_parallel:
        return s * b * h * ((26.0 + attention + latents) / t + scores)
    return s * b * h * (10.0 + latents + (16.0 + attention) / t + scores)


def gdn_mixer_bytes_per_token(gdn, seq_length: int, tensor_parallel: int = 1) -> float:
    """Bytes one Gated DeltaNet mixer (megalite.model.gated_delta_net with the torch chunked rule of
    megalite.kernels.gated_delta) keeps for backward per token of a 16-bit run, on one of
    `tensor_parallel` ranks (n_k / t key and n_v / t value heads over the whole sequence; d_k, d_v
    the head widths, C the chunk, K the convolution taps, c = 2 n_k d_k + n_v d_v the convolved
    channels). Each term is a tensor autograd saves (megalite/dryrun/README.md, "Activation memory
    of Gated DeltaNet layers")."""
    t, s, c_chunk = tensor_parallel, seq_length, gdn.chunk_size
    nk, nv = gdn.linear_num_key_heads / t, gdn.linear_num_value_heads / t
    dk, dv, taps = gdn.linear_key_head_dim, gdn.linear_value_head_dim, gdn.linear_conv_kernel_dim
    qk, vd = nk * dk, nv * dv
    conv = 2 * qk + vd
    chunks = -(-s // c_chunk)
    padded = chunks * c_chunk / s  # a ragged last chunk is padded with inert tokens
    front = (2 * (2 * qk + 2 * vd + 2 * nv)  # in_proj's output (q, k, v, z, beta, alpha views keep it)
             + 2 * conv * (1 + (taps - 1) / s)  # the convolution's zero-padded input, read by every tap
             + 4 * conv  # the activation's input and output (l2norm reads q and k, v is a view of it)
             + 4 * nk + 2 * nv + 8 * nv)  # l2norm's 1/rms of q and k; sigmoid(beta); softplus in and out (fp32)
    # fp32 per value head: 8 C x C tensors (decay, its strict part, k k^T, beta * strict, I + A,
    # the triangular solve, q k^T, the scores); q, k, beta exp(gamma) k, its solve, q exp(gamma),
    # k exp(gamma_C - gamma) (6 d_k); v, beta v, U (3 d_v); beta, exp(gamma) twice,
    # exp(gamma_C - gamma), beta exp(gamma) (5); a state per chunk. Unpadded, q and k keep the
    # [b, s, h, d] layout of their heads-first view, which the batched products q k^T and k k^T
    # cannot fold into one batch dimension: they save copies of q, k and k^T twice (4 d_k more).
    copies = 16 * dk if s % c_chunk == 0 else 0
    rule = (32 * c_chunk + 24 * dk + copies + 12 * dv + 20) * padded + 4 * dk * dv * chunks / s
    back = 18 * vd + 4 * nv  # out_norm's fp32 input, 1/rms, output (16-bit) and scaled output; z in
    # fp32 and act(z) (fp32); out_proj's input
    return front + nv * rule + back


def gdn_activation_bytes_per_layer(seq_length: int, micro_batch_size: int, hidden_size: int, gdn,
                                   tensor_parallel: int = 1, sequence_parallel: bool = False,
                                   recompute: str | None = None) -> float:
    """activation_bytes_per_layer for a Gated DeltaNet layer (`gdn`, a GDNConfig): the norms,
    residual and MLP terms shared with attention layers, and the mixer's bytes
    (gdn_mixer_bytes_per_token) in place of the 8h of Q, K, V, the projection's input and the
    scores. Selective recompute (core_attn) leaves a GDN layer as it is: its mixer recomputes nothing."""
    s, b, h, t = seq_length, micro_batch_size, hidden_size, tensor_parallel
    if recompute == "full":
        return 2.0 * s * b * h
    mixer = s * b * gdn_mixer_bytes_per_token(gdn, s, t)
    if sequence_parallel:
        return s * b * h * 26.0 / t + mixer
    return s * b * h * (10.0 + 16.0 / t) + mixer


def activation_bytes_of_layer(config: GPTConfig, layer: int, seq_length: int, micro_batch_size: int,
                              tensor_parallel: int = 1, sequence_parallel: bool = False,
                              recompute: str | None = None, flash_attention: bool = False) -> float:
    """Layer `layer`'s (global, from 0; -1 an attention layer) activation bytes:
    gdn_activation_bytes_per_layer on a Gated DeltaNet layer (--linear-attention-freq),
    activation_bytes_per_layer on the others."""
    if layer >= 0 and _is_linear(config, layer):
        return gdn_activation_bytes_per_layer(seq_length, micro_batch_size, config.hidden_size, config.gdn,
                                              tensor_parallel, sequence_parallel, recompute)
    return activation_bytes_per_layer(seq_length, micro_batch_size, config.hidden_size, config.num_attention_heads,
                                      tensor_parallel, sequence_parallel, recompute, flash_attention,
                                      mla=config.mla, latent_norms=config.qk_layernorm)


def mtp_activation_bytes(seq_length: int, micro_batch_size: int, hidden_size: int, tensor_parallel: int = 1,
                         sequence_parallel: bool = False) -> float:
    """What one MTP depth keeps besides its transformer layer (activation_bytes_per_layer):
    the inputs of enorm, hnorm, eh_proj ([e; h], 2h wide) and its final norm, 10 s b h bytes
    (sequence-split under sequence parallelism); its logits are the output layer's."""
    return 10.0 * seq_length * micro_batch_size * hidden_size / (tensor_parallel if sequence_parallel else 1)
