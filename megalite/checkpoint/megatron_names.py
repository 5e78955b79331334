"""Megatron-Core GPTModel names and arguments in megalite's terms.

megalite's parameter names are Megatron-Core's without the `decoder.` prefix, and its fused
QKV weight has Megatron's per-query-group layout ([q_g..., k_g, v_g] for each group g), so a
full tensor means the same on both sides. What differs:
  - Transformer Engine's layer specs fuse the pre-attention and pre-MLP norms into the next
    linear: `self_attention.linear_qkv.layer_norm_weight` / `layer_norm_bias` hold
    `input_layernorm`, `mlp.linear_fc1.layer_norm_*` hold `pre_mlp_layernorm`. Megatron's
    torch_dist checkpoints use the fused names for the local spec too.
  - Megatron's vocabulary tensors carry padding rows for its TP size; megalite's full tensors
    have exactly the vocabulary.
"""

import argparse
import re

from megalite.checkpoint.megatron_names_mla import (down_projection_rule, handled_fields, latent_norm_candidates,
                                                     mla_fields_from_megatron_args, mtp_candidates)
from megalite.checkpoint.publish import ConversionError
from megalite.checkpoint.target_layout import sharding_by_pattern
from megalite.model.config import GPTConfig

_FUSED_NORMS = {
    "input_layernorm.weight": "self_attention.linear_qkv.layer_norm_weight",
    "input_layernorm.bias": "self_attention.linear_qkv.layer_norm_bias",
    "pre_mlp_layernorm.weight": "mlp.linear_fc1.layer_norm_weight",
    "pre_mlp_layernorm.bias": "mlp.linear_fc1.layer_norm_bias",
}
_LAYER = re.compile(r"^layers\.(\d+)\.(.+)$")

# Megatron model features megalite's GPTConfig has no field for: loading them would compute
# something else, so they are refused by name.
_UNSUPPORTED = ("apply_layernorm_1p", "qk_layernorm", "squared_relu", "rotary_interleaved", "use_rope_scaling",
                "multi_latent_attention", "mtp_num_layers", "num_experts", "heterogeneous_layers_config_path",
                "experimental_attention_variant")


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
        return [_FUSED_NORMS[rest], rest]
    return latent_norm_candidates(rest) or [rest]


def model_names(config: GPTConfig) -> list[str]:
    """megalite's full-model tensor names in order (the tied output layer is the embedding)."""
    patterns = sharding_by_pattern(config)
    first = [p for p in patterns if p.startswith("embedding.")]
    per_layer = [p for p in patterns if p.startswith("layers.*.")]
    last = [p for p in patterns if not p.startswith(("embedding.", "layers.*."))]
    names = list(first)
    for i in range(config.num_layers):
        names += [p.replace("layers.*.", f"layers.{i}.") for p in per_layer]
    return names + last


def tp_rule(config: GPTConfig, sharding: dict, name: str) -> tuple[int, int] | None:
    """(partition dim, blocks per rank) of megalite's `name`, or None where every TP rank holds it
    whole. Megatron and megalite shard the same tensors the same way: a SwiGLU fc1 rank holds
    [its gate rows; its up rows], two blocks."""
    return down_projection_rule(name) or sharding[re.sub(r"^layers\.\d+\.", "layers.*.", name)]


def _get(ns, name, default=None):
    value = getattr(ns, name, default)
    return default if value is None else value


def config_from_megatron_args(ns: argparse.Namespace, vocab_size: int, where: str) -> GPTConfig:
    """The GPTConfig of the model a Megatron run with arguments `ns` built; `where` names the
    file in errors. Refuses Megatron features megalite's model lacks, naming the argument."""
    if not isinstance(ns, argparse.Namespace):
        raise ConversionError(f"{where}: no Megatron 'args' entry (cannot rebuild the model)")
    for field in ("num_layers", "hidden_size", "num_attention_heads"):
        if getattr(ns, field, None) is None:
            raise ConversionError(f"{where}: the checkpoint's args have no {field}")
    for field in _UNSUPPORTED:
        if getattr(ns, field, None) and field not in handled_fields(ns):
            raise ConversionError(f"{where}: the checkpoint's model uses {field}={getattr(ns, field)!r}, "
                                  "which megalite's GPT model does not have")
    position = _get(ns, "position_embedding_type", "learned_absolute")
    if position not in ("learned_absolute", "rope"):
        raise ConversionError(f"{where}: position_embedding_type={position!r} (megalite has learned_absolute and rope)")
    gqa = bool(_get(ns, "group_query_attention", False))
    activation = "swiglu" if _get(ns, "swiglu", False) else "openai_gelu" if _get(ns, "openai_gelu", False) else "gelu"
    dtype = "bfloat16" if _get(ns, "bf16", False) else "float16" if _get(ns, "fp16", False) else "float32"
    return GPTConfig(
        num_layers=ns.num_layers, hidden_size=ns.hidden_size, num_attention_heads=ns.num_attention_heads,
        vocab_size=vocab_size, max_position_embeddings=_get(ns, "max_position_embeddings", _get(ns, "seq_length", 1024)),
        num_query_groups=_get(ns, "num_query_groups") if gqa else None, kv_channels=_get(ns, "kv_channels"),
        ffn_hidden_size=_get(ns, "ffn_hidden_size"), position_embedding_type=position,
        rotary_base=float(_get(ns, "rotary_base", 10000)), rotary_percent=float(_get(ns, "rotary_percent", 1.0)),
        normalization=_get(ns, "normalization", "LayerNorm"), norm_epsilon=float(_get(ns, "norm_epsilon", 1e-5)),
        activation=activation, add_bias_linear=bool(_get(ns, "add_bias_linear", True)),
        add_qkv_bias=bool(_get(ns, "add_qkv_bias", False)),
        untie_embeddings_and_output_weights=bool(_get(ns, "untie_embeddings_and_output_weights", False)),
        make_vocab_size_divisible_by=int(_get(ns, "make_vocab_size_divisible_by", 128)),
        init_method_std=float(_get(ns, "init_method_std", 0.02)),
        attention_dropout=float(_get(ns, "attention_dropout", 0.1)), hidden_dropout=float(_get(ns, "hidden_dropout", 0.1)),
        params_dtype=dtype, **mla_fields_from_megatron_args(ns))


def vocab_size_of(ns: argparse.Namespace, padded_rows: int) -> int:
    """The unpadded vocabulary: Megatron stores it only for --vocab-size / NullTokenizer runs;
    otherwise the padded size (the caller's tokenizer, when it has one, decides)."""
    return int(_get(ns, "vocab_size", 0) or padded_rows)
