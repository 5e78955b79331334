"""Parameters one rank holds, counted from the model's shape as megalite builds it (weights,
biases, norms; the vocabulary padded to a multiple of make_vocab_size_divisible_by x t).

Dense parameters are replicated over data parallelism (sharded over DP x CP by the distributed
optimizer); expert parameters are split over the EP ranks and sharded over the rest (EDP).
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


def layer_parameters(config: GPTConfig, layer: int, t: int, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of transformer layer `layer` on one TP (and EP) rank."""
    h, d = config.hidden_size, config.kv_channels
    q, kv = config.num_attention_heads * d, config.num_query_groups * d
    qkv_bias = config.add_bias_linear or config.add_qkv_bias
    attention = h * (q + 2 * kv) // t + (q + 2 * kv) // t * qkv_bias + q * h // t + h * config.add_bias_linear
    if config.qk_layernorm:
        attention += 2 * _norm(config, d)
    dense = 2 * _norm(config, h) + attention
    moe = config.moe
    if moe is None or not moe.is_moe_layer(layer, config.num_layers):
        return dense + _mlp(config, config.ffn_hidden_size, t, config.add_bias_linear), 0
    dense += h * moe.num_experts  # the router, replicated
    if moe.shared_expert_intermediate_size:
        dense += _mlp(config, moe.shared_expert_intermediate_size, t, False) + h * moe.shared_expert_gate
    expert = moe.num_experts // ep * _mlp(config, moe.ffn_hidden_size, t, False)
    return dense, expert


def chunk_parameters(config: GPTConfig, t: int, p: int, v: int, rank: int, chunk: int,
                     ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters of model chunk `chunk` of pipeline rank `rank`."""
    dense = expert = 0
    for layer in stage_layers(config.num_layers, p, rank, chunk, v):
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
        if config.untie_embeddings_and_output_weights or not first:
            dense += vocab  # the output layer, or the tied embedding's copy on the last stage
    return dense, expert


def rank_parameters(config: GPTConfig, t: int, p: int, v: int, rank: int, ep: int = 1) -> tuple[int, int]:
    """(dense, expert) parameters over all chunks of pipeline rank `rank`."""
    parts = [chunk_parameters(config, t, p, v, rank, c, ep) for c in range(v)]
    return sum(d for d, _ in parts), sum(e for _, e in parts)
