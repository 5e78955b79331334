"""Parameters one rank holds, counted from the model's shape as megalite builds it (weights,
biases, norms; the vocabulary padded to a multiple of make_vocab_size_divisible_by x t).

Dense parameters are replicated over data parallelism (sharded over DP x CP by the distributed
optimizer); expert parameters are split over the EP ranks and sharded over the rest (EDP).
Multi-latent attention's down projections and latent norms are whole on every TP rank; the MTP
depths, and a copy of the embedding where they are not on the first stage, are the last stage's.
tests/planner check these counts against models megalite builds.
"""

from megalite.model.config import GPTConfig
from megalite.parallel.pipeline.stage_layout import stage_layers


def _norm(config: GPTConfig, size: int) -> int:
    return size * (2 if config.normalization == "LayerNorm" else 1)


def _mlp(config: GPTConfig, ffn: int, t: int, bias: bool) -> int:
    """A dense (or shared-expert) MLP's parameters on one TP rank."""
    h, up = config.hidden_size, 2 if config.activation == "swiglu" else 1
    return h * ffn * up // t + ffn * h // t + ((ffn * up // t + h) if bias else 0)


def _mla_attention(config: GPTConfig, t: int) -> int:
    """Multi-latent attention's parameters on one TP rank (heads split, latents whole)."""
    h, a, mla = config.hidden_size, config.num_attention_heads, config.mla
    up = a * mla.q_head_dim // t
    q = h * up if mla.q_lora_rank is None else h * mla.q_lora_rank + mla.q_lora_rank * up
    kv = h * (mla.kv_lora_rank + mla.qk_pos_emb_head_dim) + mla.kv_lora_rank * a * (mla.qk_head_dim + mla.v_head_dim) // t
    norms = _norm(config, mla.kv_lora_rank) + (_norm(config, mla.q_lora_rank) if mla.q_lora_rank else 0)
    return q + kv + a * mla.v_head_dim // t * h + h * config.add_bias_linear + norms * config.qk_layernorm


def _gdn_attention(config: GPTConfig, t: int) -> int:
    """A Gated DeltaNet layer's parameters on one TP rank: in_proj, conv1d, A_log, dt_bias and
    out_proj split by heads, out_norm whole."""
    gdn, h = config.gdn, config.hidden_size
    conv = (2 * gdn.qk_dim + gdn.v_dim) * gdn.linear_conv_kernel_dim
    return (h * sum(gdn.in_proj_sections()) + conv + 2 * gdn.linear_num_value_heads + gdn.v_dim * h) // t \
        + _norm(config, gdn.linear_value_head_dim)


def _is_linear(config: GPTConfig, layer: int) -> bool:
    return config.gdn is not None and config.gdn.is_linear_layer(layer, config.num_layers)


def layer_parameters(config: GPTConfig, layer: int, t: int, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of transformer layer `layer` on one TP (and EP) rank (an MTP
    depth's layer numbered from num_layers)."""
    h, d = config.hidden_size, config.kv_channels
    q, kv = config.num_attention_heads * d, config.num_query_groups * d
    qkv_bias = config.add_bias_linear or config.add_qkv_bias
    gates = q if config.attention_output_gate else 0
    attention = h * (q + gates + 2 * kv) // t + (q + gates + 2 * kv) // t * qkv_bias + q * h // t \
        + h * config.add_bias_linear
    if config.qk_layernorm:
        attention += 2 * _norm(config, d)
    if config.mla is not None:
        attention = _mla_attention(config, t)
    if _is_linear(config, layer):
        attention = _gdn_attention(config, t)
    dense = 2 * _norm(config, h) + attention
    moe = config.moe
    if moe is None or not moe.is_moe_layer(layer, config.num_layers):
        return dense + _mlp(config, config.ffn_hidden_size, t, config.add_bias_linear), 0
    dense += h * moe.num_experts  # the router, replicated
    if moe.shared_expert_intermediate_size:
        dense += _mlp(config, moe.shared_expert_intermediate_size, t, False) + h * moe.shared_expert_gate
    expert = moe.num_experts // ep * _mlp(config, moe.ffn_hidden_size, t, False)
    return dense, expert


def fused_linear_weights(config: GPTConfig, layer: int, t: int) -> int:
    """The weights of transformer layer `layer` on one TP rank whose gradients
    --gradient-accumulation-fusion accumulates inside the weight-gradient GEMM: the column- and
    row-parallel linears of standard attention, of a dense MLP and of a shared expert (routed
    experts, the router, norms, biases and multi-latent attention's projections keep the hook's add)."""
    h, d = config.hidden_size, config.kv_channels
    q, kv = config.num_attention_heads * d, config.num_query_groups * d
    attention = 0 if config.mla is not None else h * (q * (1 + config.attention_output_gate) + 2 * kv) // t + q * h // t
    if _is_linear(config, layer):  # in_proj and out_proj
        attention = h * (sum(config.gdn.in_proj_sections()) + config.gdn.v_dim) // t
    moe = config.moe
    if moe is None or not moe.is_moe_layer(layer, config.num_layers):
        return attention + _mlp(config, config.ffn_hidden_size, t, False)
    return attention + (_mlp(config, moe.shared_expert_intermediate_size, t, False)
                        if moe.shared_expert_intermediate_size else 0)


def chunk_parameters(config: GPTConfig, t: int, p: int, v: int, rank: int, chunk: int,
                     ep: int = 1, split: dict | None = None) -> tuple[int, int]:
    """(dense, expert) parameters of model chunk `chunk` of pipeline rank `rank` (`split`:
    stage_layers' keyword arguments, Workload.layer_split; None: the even split)."""
    dense = expert = 0
    for layer in stage_layers(config.num_layers, p, rank, chunk, v, **(split or {})):
        d, e = layer_parameters(config, layer, t, ep)
        dense, expert = dense + d, expert + e
    vocab = config.padded_vocab_size(t) // t * config.hidden_size
    first, last = rank == 0 and chunk == 0, rank == p - 1 and chunk == v - 1
    if first:
        dense += vocab
        if config.position_embedding_type == "learned_absolute":
            dense += config.max_position_embeddings * config.hidden_size
    if last:
        dense += _norm(config, config.hidden_size)
        mtp = config.mtp_num_layers or 0
        if mtp and not first:  # MTP's copy of the embedding, which a tied output layer uses
            dense += vocab + (config.max_position_embeddings * config.hidden_size
                              if config.position_embedding_type == "learned_absolute" else 0)
        if config.untie_embeddings_and_output_weights or not (first or mtp):
            dense += vocab  # the output layer, or the tied embedding's copy on the last stage
        for depth in range(mtp):  # enorm, hnorm, eh_proj, final norm and a layer
            d, e = layer_parameters(config, config.num_layers + depth, t, ep)
            dense, expert = dense + d + 3 * _norm(config, config.hidden_size) + 2 * config.hidden_size ** 2 // t, expert + e
    return dense, expert


def rank_parameters(config: GPTConfig, t: int, p: int, v: int, rank: int, ep: int = 1,
                    split: dict | None = None) -> tuple[int, int]:
    """(dense, expert) parameters over all chunks of pipeline rank `rank`."""
    parts = [chunk_parameters(config, t, p, v, rank, c, ep, split) for c in range(v)]
    return sum(d for d, _ in parts), sum(e for _, e in parts)
