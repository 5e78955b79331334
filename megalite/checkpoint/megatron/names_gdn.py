"""Megatron-Core Gated DeltaNet names and arguments in megalite's terms (used by names.py, args.py
and reader.py).

Names, per linear-attention layer (megalite keeps Megatron-Core's GatedDeltaNet names):
  self_attention.in_proj.weight     `torch` files: each rank's rows [q, k, v, z, beta, alpha] of its
                                    heads (every block split over TP on its own). `torch_dist`
                                    stores the six blocks as separate full tensors
                                    in_proj.weight.{query,key,value,z,beta,alpha}
                                    (GatedDeltaNet.sharded_state_dict's _split_tensor_factory).
  self_attention.conv1d.weight      likewise, blocks {query,key,value}
  self_attention.A_log, dt_bias, out_norm.weight, out_proj.weight      the same in megalite
  input_layernorm.weight            Transformer Engine's spec fuses it into in_proj:
                                    self_attention.in_proj.layer_norm_weight
Full-attention layers with --attention-output-gate keep linear_qkv's names (megalite's fused
QKV has Megatron's per-group [q, gate, k, v] layout).

Arguments: --experimental-attention-variant gated_delta_net (megatron-core 0.16; `gdn` at
Megatron-LM HEAD), --linear-attention-freq (an int or a list, as Megatron's moe_freq_type parses
it) and the --linear-* shapes become megalite's GDNConfig; --attention-output-gate its own field.
"""

from megalite.checkpoint.publish import ConversionError
from megalite.model.gdn_config import GDNConfig

GDN_VARIANTS = ("gdn", "gated_delta_net")
_SPLIT_PARTS = {
    "self_attention.in_proj.weight": ("query", "key", "value", "z", "beta", "alpha"),
    "self_attention.conv1d.weight": ("query", "key", "value"),
}
_GDN_ATTENTION = tuple(f"layers.*.self_attention.{n}" for n in ("in_proj.", "conv1d.", "A_log", "dt_bias",
                                                                  "out_norm.", "out_proj."))
_FUSED_INPUT_NORM = {"input_layernorm.weight": "self_attention.in_proj.layer_norm_weight"}


def split_parts(candidate: str) -> list[str] | None:
    """The `torch_dist` names of the blocks Megatron stores Megatron's `candidate` as (concatenated
    along rows they are the full tensor), or None for a tensor stored whole."""
    for suffix, parts in _SPLIT_PARTS.items():
        if candidate.endswith("." + suffix):
            return [f"{candidate}.{part}" for part in parts]
    return None


def read_in_parts(candidate: str, read) -> list[tuple[str, object]] | None:
    """[(block name, read(block name))] of the blocks Megatron stores `candidate` as, or None
    for a tensor stored whole."""
    parts = split_parts(candidate)
    return None if parts is None else [(part, read(part)) for part in parts]


def is_gdn_attention(pattern: str) -> bool:
    """Whether megalite's `pattern` (layers.*.self_attention.<...>) is a Gated DeltaNet tensor."""
    return pattern.startswith(_GDN_ATTENTION)


def fused_input_norm(rest: str) -> str | None:
    """Transformer Engine's name of a GDN layer's input norm (fused into in_proj), else None."""
    return _FUSED_INPUT_NORM.get(rest)


def _get(ns, name, default=None):
    value = getattr(ns, name, default)
    return default if value is None else value


def gdn_handled_fields(ns) -> tuple[str, ...]:
    """The refused-by-default arguments megalite builds from these args (other variants: refused)."""
    return ("experimental_attention_variant",) if _get(ns, "experimental_attention_variant") in GDN_VARIANTS else ()


def gdn_fields_from_megatron_args(ns, where: str) -> dict:
    """The GPTConfig fields (gdn, attention_output_gate) of a Megatron run's arguments."""
    fields = {"attention_output_gate": bool(_get(ns, "attention_output_gate", False))}
    if _get(ns, "experimental_attention_variant") not in GDN_VARIANTS:
        return {**fields, "gdn": None}
    freq = _get(ns, "linear_attention_freq")
    if freq is None:
        raise ConversionError(f"{where}: the checkpoint's model uses experimental_attention_variant="
                              f"{ns.experimental_attention_variant!r} without linear_attention_freq "
                              "(Megatron refuses it)")
    defaults = GDNConfig()
    try:
        gdn = GDNConfig(linear_attention_freq=tuple(freq) if isinstance(freq, list) else int(freq),
                        **{name: int(_get(ns, name, getattr(defaults, name))) for name in (
                            "linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                            "linear_num_key_heads", "linear_num_value_heads")})
        gdn.layer_pattern(int(ns.num_layers))
    except ValueError as e:
        raise ConversionError(f"{where}: the checkpoint's Gated DeltaNet arguments: {e}") from None
    return {**fields, "gdn": gdn}
