"""The model a Megatron-LM run built, read from the `args` Namespace it stored with its
checkpoint: megalite's GPTConfig for it, or a refusal naming the argument megalite's GPT model
has no counterpart for. No argument that changes the forward pass is dropped.

What an argument does is what Megatron-LM's own path from args to model does with it
(megatron/training/arguments.py core_transformer_config_from_args copies every TransformerConfig
field by name; the GPT builder passes GPTModel its position options), which differs by version:
  - From core_v0.16 the TransformerConfig fields are the arguments: --norm-epsilon and
    --apply-layernorm-1p are stored as layernorm_epsilon and layernorm_zero_centered_gamma
    (before: norm_epsilon, apply_layernorm_1p).
  - --rotary-seq-len-interpolation-factor reaches the model only since the ModelBuilder path
    (commit 223e244f, 2026-06-30, in core_v0.19.0); gpt_builders.gpt_builder before it never
    passed it, so those models ran without it.
  - --rope-scaling-factor reaches no model: neither builder passes it, GPTModel's default 8.0
    is what every --use-rope-scaling model used.
  - --openai-gelu and --onnx-safe are read by the legacy model only. Megatron-Core's MLP computes
    GeLU with the tanh approximation when the bias-GeLU fusion is on (--no-bias-gelu-fusion not
    given, biases on) or Transformer Engine's activation is used, exact GeLU otherwise.
  - NullTokenizer: --vocab-size + 1 tokens (the EOD id appended) before commit c9dfe347
    (core_v0.18.0, which added --null-tokenizer-eod-id), --vocab-size tokens since.
"""

import argparse

from megalite.checkpoint.megatron.names_gdn import gdn_fields_from_megatron_args, gdn_handled_fields
from megalite.checkpoint.megatron.names_mla import handled_fields, mla_fields_from_megatron_args
from megalite.checkpoint.megatron.names_moe import moe_fields_from_megatron_args
from megalite.checkpoint.publish import ConversionError
from megalite.model.config import GPTConfig

# Arguments that build what megalite's GPT model does not have, with the value meaning "not
# used" (None, False and 0 always do).
_REFUSED = {
    "use_legacy_models": False, "multi_latent_attention": False, "mtp_num_layers": None,
    "heterogeneous_layers_config_path": None, "experimental_attention_variant": None,
    "is_hybrid_model": False, "hybrid_override_pattern": None, "hybrid_layer_pattern": None, "spec": None,
    "yaml_cfg": None, "apply_residual_connection_post_layernorm": False, "qk_l2_norm": False,
    "window_size": None, "no_rope_freq": None, "quick_geglu": False,
    "softmax_type": "vanilla", "glu_linear_offset": 0.0, "activation_func_clamp_value": None, "use_mup": False,
    "enable_mhc_connections": False, "mtp_use_repeated_layer": False, "mtp_hsm": False,
    "mtp_hybrid_override_pattern": None,
}
_POSITIONS = ("learned_absolute", "rope", "none")
_NORMS = ("LayerNorm", "RMSNorm")
# Present in args written after the ModelBuilder commit 223e244f (from 69c48682, 2026-07-02) /
# before it (from f88b85f8, 2026-06-28): args with neither were written before it.
_AFTER_MODEL_BUILDER, _BEFORE_MODEL_BUILDER = "delay_offload_until_cuda_graph", "dataloader_inter_document_masking"
_MEGATRON_ROPE_SCALING_FACTOR = 8.0


def _get(ns, name, default=None):
    value = getattr(ns, name, default)
    return default if value is None else value


def _first(ns, names, default):
    """The value of the first of `names` the args hold (a renamed argument's spellings)."""
    for name in names:
        if getattr(ns, name, None) is not None:
            return getattr(ns, name)
    return default


def _refuse(where, field, value, why="which megalite's GPT model does not have"):
    raise ConversionError(f"{where}: the checkpoint's model uses {field}={value!r}, {why}")


def _builder_passes_interpolation(ns) -> bool | None:
    """Whether the Megatron-LM that wrote `ns` passed --rotary-seq-len-interpolation-factor to
    the model (None: written between the marker commits, it cannot be told)."""
    if hasattr(ns, _AFTER_MODEL_BUILDER):
        return True
    return None if hasattr(ns, _BEFORE_MODEL_BUILDER) else False


def _interpolation_factor(ns, where) -> float | None:
    """The RoPE position interpolation factor the checkpoint's model ran with."""
    factor = _get(ns, "rotary_seq_len_interpolation_factor")
    passed = _builder_passes_interpolation(ns)
    if factor is None or passed is False:
        return None
    if passed is None:
        _refuse(where, "rotary_seq_len_interpolation_factor", factor, "and was written by a Megatron-LM of "
                "2026-06-28..07-02, which may or may not have passed it to the model (commit 223e244f)")
    return float(factor)


def megatron_args_notes(ns: argparse.Namespace) -> list[str]:
    """Arguments the checkpoint's args hold that its model did not use, one line each."""
    if _position(ns) != "rope":
        return []
    notes = []
    factor = _get(ns, "rotary_seq_len_interpolation_factor")
    if factor is not None and _builder_passes_interpolation(ns) is False:
        notes.append(f"rotary_seq_len_interpolation_factor={factor} is not converted: the Megatron-LM that wrote "
                     "the checkpoint (before core_v0.19) did not pass it to the model, which ran without it")
    scaling = _get(ns, "rope_scaling_factor", _MEGATRON_ROPE_SCALING_FACTOR)
    if _get(ns, "use_rope_scaling", False) and float(scaling) != _MEGATRON_ROPE_SCALING_FACTOR:
        notes.append(f"rope_scaling_factor={scaling} is not converted: Megatron-LM does not pass it to the model, "
                     f"which scaled RoPE by GPTModel's {_MEGATRON_ROPE_SCALING_FACTOR}")
    return notes


def _position(ns) -> str:
    if _get(ns, "use_rotary_position_embeddings", False):  # deprecated form, as Megatron's validate_args reads it
        return "rope"
    return _get(ns, "position_embedding_type", "learned_absolute")


def _activation(ns, add_bias_linear: bool, where) -> str:
    swiglu, squared = bool(_get(ns, "swiglu", False)), bool(_get(ns, "squared_relu", False))
    if swiglu and squared:
        _refuse(where, "squared_relu", True, "and swiglu=True (Megatron refuses the two together)")
    if swiglu or squared:
        return "swiglu" if swiglu else "squared_relu"
    fused = bool(_get(ns, "bias_gelu_fusion", True)) and add_bias_linear
    return "openai_gelu" if fused or _get(ns, "use_te_activation_func", False) else "gelu"


def _check_refused(ns, where) -> None:
    handled = handled_fields(ns) + gdn_handled_fields(ns)
    for field, unused in _REFUSED.items():
        value = getattr(ns, field, None)
        if value not in (None, False, unused) and field not in handled and field != "num_experts":
            _refuse(where, field, value)
    if getattr(ns, "use_mcore_models", True) is False:  # stored before core_v0.8, where legacy was the default
        _refuse(where, "use_mcore_models", False, "Megatron's legacy GPT model (megalite reads Megatron-Core's)")


def config_from_megatron_args(ns: argparse.Namespace, vocab_size: int, where: str) -> GPTConfig:
    """The GPTConfig of the model a Megatron run with arguments `ns` built; `where` names the
    file in errors. Refuses Megatron features megalite's model lacks, naming the argument."""
    if not isinstance(ns, argparse.Namespace):
        raise ConversionError(f"{where}: no Megatron 'args' entry (cannot rebuild the model)")
    for field in ("num_layers", "hidden_size", "num_attention_heads"):
        if getattr(ns, field, None) is None:
            raise ConversionError(f"{where}: the checkpoint's args have no {field}")
    _check_refused(ns, where)
    position = _position(ns)
    if position not in _POSITIONS:
        _refuse(where, "position_embedding_type", position, f"which megalite does not have (it has {_POSITIONS})")
    normalization = _get(ns, "normalization", "LayerNorm")
    if normalization not in _NORMS:
        _refuse(where, "normalization", normalization, f"which megalite does not have (it has {_NORMS})")
    rope = position == "rope"
    add_bias_linear = bool(_get(ns, "add_bias_linear", True))
    if getattr(ns, "disable_bias_linear", None) is not None:  # older args; Megatron's loader lets it win
        add_bias_linear = not ns.disable_bias_linear
    gqa = bool(_get(ns, "group_query_attention", False))
    dtype = "bfloat16" if _get(ns, "bf16", False) else "float16" if _get(ns, "fp16", False) else "float32"
    latent = mla_fields_from_megatron_args(ns)
    latent.pop("qk_layernorm", None)  # MLA's latent norms: the same argument, read below
    return GPTConfig(
        num_layers=ns.num_layers, hidden_size=ns.hidden_size, num_attention_heads=ns.num_attention_heads,
        vocab_size=vocab_size, max_position_embeddings=_get(ns, "max_position_embeddings", _get(ns, "seq_length", 1024)),
        num_query_groups=_get(ns, "num_query_groups") if gqa else None, kv_channels=_get(ns, "kv_channels"),
        ffn_hidden_size=_get(ns, "ffn_hidden_size"), position_embedding_type=position,
        rotary_base=float(_get(ns, "rotary_base", 10000)) if rope else 10000.0,
        rotary_percent=float(_get(ns, "rotary_percent", 1.0)) if rope else 1.0,
        rotary_interleaved=rope and bool(_get(ns, "rotary_interleaved", False)),
        rotary_seq_len_interpolation_factor=_interpolation_factor(ns, where) if rope else None,
        use_rope_scaling=rope and bool(_get(ns, "use_rope_scaling", False)),
        rope_scaling_factor=_MEGATRON_ROPE_SCALING_FACTOR,
        normalization=normalization, norm_epsilon=float(_first(ns, ("layernorm_epsilon", "norm_epsilon"), 1e-5)),
        apply_layernorm_1p=bool(_first(ns, ("layernorm_zero_centered_gamma", "apply_layernorm_1p"), False)),
        qk_layernorm=bool(_get(ns, "qk_layernorm", False)),
        activation=_activation(ns, add_bias_linear, where), add_bias_linear=add_bias_linear,
        add_qkv_bias=bool(_get(ns, "add_qkv_bias", False)),
        untie_embeddings_and_output_weights=bool(_get(ns, "untie_embeddings_and_output_weights", False)),
        make_vocab_size_divisible_by=int(_get(ns, "make_vocab_size_divisible_by", 128)),
        init_method_std=float(_get(ns, "init_method_std", 0.02)),
        attention_dropout=float(_get(ns, "attention_dropout", 0.1)), hidden_dropout=float(_get(ns, "hidden_dropout", 0.1)),
        params_dtype=dtype, **latent, **moe_fields_from_megatron_args(ns, where),
        **gdn_fields_from_megatron_args(ns, where))


def _padded(vocab: int, ns) -> int:
    multiple = int(_get(ns, "make_vocab_size_divisible_by", 128)) * int(_get(ns, "tensor_model_parallel_size", 1))
    return -(-vocab // multiple) * multiple


def vocab_size_of(ns: argparse.Namespace, padded_rows: int) -> int:
    """The unpadded vocabulary. Megatron stores it only as --vocab-size, which only NullTokenizer
    and TikTokenizer read; a NullTokenizer's has --vocab-size + 1 tokens or --vocab-size (by
    version): where only one of the two pads to the embedding's `padded_rows`, the embedding
    decides. Otherwise the padded size (the caller's tokenizer, when it has one, decides)."""
    stored, tokenizer = _get(ns, "vocab_size"), _get(ns, "tokenizer_type")
    if not stored or tokenizer not in (None, "NullTokenizer", "TikTokenizer"):
        return int(padded_rows)
    if tokenizer != "NullTokenizer":
        return int(stored)
    by_version = int(stored) + (0 if hasattr(ns, "null_tokenizer_eod_id") else 1)
    fits = [v for v in (int(stored), int(stored) + 1) if _padded(v, ns) == padded_rows]
    return fits[0] if len(fits) == 1 else by_version
