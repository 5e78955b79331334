"""Megatron-Core GPTModel names in megalite's terms (its arguments: megatron.args).

megalite's parameter names are Megatron-Core's without the `decoder.` prefix, and its fused
QKV weight has Megatron's per-query-group layout ([q_g..., k_g, v_g] for each group g), so a
full tensor means the same on both sides. What differs:
  - Transformer Engine's layer specs fuse the pre-attention and pre-MLP norms into the next
    linear: `self_attention.linear_qkv.layer_norm_weight` / `layer_norm_bias` hold
    `input_layernorm`, `mlp.linear_fc1.layer_norm_*` hold `pre_mlp_layernorm`. Megatron's
    torch_dist checkpoints use the fused names for the local spec too.
  - Gated DeltaNet layers (names_gdn.py): Megatron's `torch_dist` stores in_proj and conv1d as
    separate blocks (query, key, value, z, beta, alpha), read concatenated.
  - Megatron's vocabulary tensors carry padding rows for its TP size; megalite's full tensors
    have exactly the vocabulary.
"""

import re

from megalite.checkpoint.megatron.names_gdn import fused_input_norm, is_gdn_attention
from megalite.checkpoint.megatron.names_mla import down_projection_rule, latent_norm_candidates, mtp_candidates
from megalite.checkpoint.megatron.names_moe import expert_candidates
from megalite.checkpoint.dcp.target_layout import sharding_by_pattern
from megalite.model.config import GPTConfig

_FUSED_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")


def megatron_candidates(name: str) -> list[str]:
    """Megatron names (global layer numbers, `decoder.` prefix) that may hold megalite's `name`,
    the fused Transformer Engine name first."""
    mtp = mtp_candidates(name, _layer_candidates)
    if mtp is not None:
        return mtp
    layer = _LAYER.match(name)
    if layer:
        number, rest = layer.groups()
        names = _layer_candidates(rest)
        return [f"decoder.layers.{number}.{n}" for n in names]
    if name.startswith("final_layernorm."):
        return [f"decoder.{name}"]
    return [name]


def _layer_candidates(rest: str) -> list[str]:
    """Megatron names of `rest` within a layer, the fused Transformer Engine name first."""
    if rest in _FUSED_NORMS:
        gdn = fused_input_norm(rest)  # a Gated DeltaNet layer's, fused into its in_proj
        return [_FUSED_NORMS[rest], *([gdn] if gdn else []), rest]
    return latent_norm_candidates(rest) or expert_candidates(rest) or [rest]


def model_names(config: GPTConfig) -> list[str]:
    """megalite's full-model tensor names in order (the tied output layer is the embedding)."""
    patterns = sharding_by_pattern(config)
    first = [p for p in patterns if p.startswith("embedding.")]
    per_layer = [p for p in patterns if p.startswith("layers.*.")]
    last = [p for p in patterns if not p.startswith(("embedding.", "layers.*."))]
    names = list(first)
    for i in range(config.num_layers):
        names += [p.replace("layers.*.", f"layers.{i}.") for p in _layer_patterns(config, per_layer, i)]
    return names + last


def _layer_patterns(config: GPTConfig, per_layer: list[str], layer: int) -> list[str]:
    """The per-layer patterns layer `layer` has: an MoE layer's router and experts, or a dense
    layer's MLP; a Gated DeltaNet layer's attention or a full-attention layer's (the probe model
    has both kinds)."""
    if config.gdn is not None:
        linear = config.gdn.is_linear_layer(layer, config.num_layers)
        per_layer = [p for p in per_layer if not p.startswith("layers.*.self_attention.")
                     or is_gdn_attention(p) == linear]
    if config.moe is None:
        return per_layer
    moe_only = ("layers.*.mlp.router.", "layers.*.mlp.local_experts.", "layers.*.mlp.shared_experts.")
    dense_only = ("layers.*.mlp.linear_fc1.", "layers.*.mlp.linear_fc2.")
    is_moe = config.moe.is_moe_layer(layer, config.num_layers)
    return [p for p in per_layer if not p.startswith(dense_only if is_moe else moe_only)]


def tp_rule(config: GPTConfig, sharding: dict, name: str) -> tuple[int, int | tuple] | None:
    """(partition dim, blocks per rank) of megalite's `name`, or None where every TP rank holds it
    whole. Megatron and megalite shard the same tensors the same way: a SwiGLU fc1 rank holds
    [its gate rows; its up rows], two blocks; a GDN in_proj rank its slice of each of six unequal
    blocks (the blocks' full sizes, a tuple; pieces of the full size are whole copies)."""
    return down_projection_rule(name, config.mla) or sharding[re.sub(r"^layers\.\d+\.", "layers.*.", name)]
