"""Megatron-Core multi-latent attention and multi-token prediction names and arguments in
megalite's terms (used by names.py).

Names: megalite keeps Megatron-Core's local layer spec's names (linear_q_down_proj, q_layernorm,
linear_q_up_proj, linear_kv_down_proj, kv_layernorm, linear_kv_up_proj; mtp.layers.k.enorm,
hnorm, eh_proj, final_layernorm). Transformer Engine's specs fuse the latent norms into the up
projections (linear_q_up_proj.layer_norm_weight, linear_kv_up_proj.layer_norm_weight). An MTP
depth's transformer layer is `transformer_layer` up to megatron-core 0.16 and `mtp_model_layer`
at Megatron-LM HEAD (megalite's name).

Arguments: Megatron builds an MLATransformerConfig from the fields `args` has; YaRN's original
context and betas are MLATransformerConfig fields no flag sets (its --yarn-* flags reach only
standard attention's YaRN), so a Megatron MLA model computed with 4096, 32 and 1 whatever its
--yarn-* flags said, and is loaded so.
"""

import re

from megalite.model.mla_config import MLAConfig

_MTP_LAYER = re.compile(r"^mtp\.layers\.(\d+)\.mtp_model_layer\.(.+)$")
_FUSED_LATENT_NORMS = {
    "self_attention.q_layernorm.weight": "self_attention.linear_q_up_proj.layer_norm_weight",
    "self_attention.kv_layernorm.weight": "self_attention.linear_kv_up_proj.layer_norm_weight",
}
_DOWN_PROJECTIONS = ("self_attention.linear_q_down_proj.weight", "self_attention.linear_kv_down_proj.weight")


def latent_norm_candidates(rest: str) -> list[str] | None:
    """Megatron names of an MLA latent norm within a layer (Transformer Engine's fused one
    first), or None for any other tensor."""
    return [_FUSED_LATENT_NORMS[rest], rest] if rest in _FUSED_LATENT_NORMS else None


def mtp_candidates(name: str, layer_candidates) -> list[str] | None:
    """Megatron names of megalite's `name` inside an MTP depth's transformer layer, or None for
    any other tensor. `layer_candidates(rest)`: the names a decoder layer's `rest` may have."""
    match = _MTP_LAYER.match(name)
    if match is None:
        return None
    depth, rest = match.groups()
    return [f"mtp.layers.{depth}.{inner}.{n}" for inner in ("mtp_model_layer", "transformer_layer")
            for n in layer_candidates(rest)]


def down_projection_rule(name: str, mla: MLAConfig | None) -> tuple[int, tuple[int]] | None:
    """How Megatron's per-rank `torch` files hold an MLA down projection: the local spec's
    ColumnParallelLinear splits it over TP along its rows, Transformer Engine's duplicated linear
    gives every rank the whole of it (megalite replicates it). The rule names the full row count
    (one block, a tuple: torch_files.merge_tp), so that full-size pieces read as copies."""
    if mla is None or not name.endswith(_DOWN_PROJECTIONS):
        return None
    rows = mla.q_lora_rank if name.endswith(_DOWN_PROJECTIONS[0]) else mla.kv_lora_rank + mla.qk_pos_emb_head_dim
    return (0, (rows,))


def _get(ns, name, default=None):
    value = getattr(ns, name, default)
    return default if value is None else value


def handled_fields(ns) -> tuple[str, ...]:
    """Megatron model features that megalite builds (from these arguments) rather than refuses."""
    return ("multi_latent_attention", "mtp_num_layers", "qk_layernorm") if _get(ns, "multi_latent_attention") \
        else ("mtp_num_layers",)


def mla_fields_from_megatron_args(ns) -> dict:
    """The GPTConfig fields of a Megatron run's multi-latent attention and MTP arguments."""
    fields = {"mtp_num_layers": _get(ns, "mtp_num_layers") or None,
              "mtp_loss_scaling_factor": float(_get(ns, "mtp_loss_scaling_factor", 0.1))}
    if not _get(ns, "multi_latent_attention", False):
        return fields
    mla = MLAConfig(q_lora_rank=_get(ns, "q_lora_rank"), kv_lora_rank=int(_get(ns, "kv_lora_rank", 32)),
                    qk_head_dim=int(_get(ns, "qk_head_dim", 128)), qk_pos_emb_head_dim=int(_get(ns, "qk_pos_emb_head_dim", 64)),
                    v_head_dim=int(_get(ns, "v_head_dim", 128)), rope_type=_get(ns, "rope_type", "yarn"),
                    rotary_scaling_factor=float(_get(ns, "rotary_scaling_factor", 1.0)),
                    mscale=float(_get(ns, "mscale", 1.0)), mscale_all_dim=float(_get(ns, "mscale_all_dim", 0.0)))
    return {**fields, "mla": mla, "qk_layernorm": bool(_get(ns, "qk_layernorm", False))}
