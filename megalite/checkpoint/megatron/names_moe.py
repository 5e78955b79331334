"""Megatron-Core mixture-of-experts names and arguments in megalite's terms (used by names.py,
args.py and reader.py).

Names, per MoE layer (Megatron-Core's local and Transformer Engine specs name them alike; the
pre-MLP norm of an MoE layer is a separate norm in both):
  mlp.router.weight, mlp.router.expert_bias          the same in megalite
  mlp.shared_experts.{linear_fc1,linear_fc2}.weight, mlp.shared_experts.gate_weight   the same
  mlp.experts.local_experts.<e>.linear_fc{1,2}.weight (SequentialMLP; in `torch` files <e> is
      local to the EP rank, as TEGroupedMLP's linear_fc{1,2}.weight<e> and the legacy
      GroupedMLP's weight1/weight2 are: torch_files.py; `torch_dist` stores every expert's under
      decoder.layers.mlp.experts.experts.linear_fc{1,2}.weight, [layer, expert, ...], and the
      grouped-GEMM experts' sharded state dicts are the same by Megatron's construction)
      -> megalite's mlp.local_experts.<e>.linear_fc{1,2}.weight, <e> global.
The reader asks for Megatron's name with the global expert number,
`decoder.layers.<l>.mlp.experts.local_experts.<e>.<rest>`; each file format finds it.
"""

import re

from megalite.checkpoint.publish import ConversionError
from megalite.model.moe_config import MoEConfig

_EXPERT = re.compile(r"^mlp\.local_experts\.(\d+)\.(.+)$")
GLOBAL_EXPERT = re.compile(r"^decoder\.layers\.(\d+)\.mlp\.experts\.local_experts\.(\d+)\.(.+)$")
DIST_EXPERT_PREFIX = "decoder.layers.mlp.experts.experts."


def expert_candidates(rest: str) -> list[str] | None:
    """Megatron names (within a layer) of megalite's routed-expert tensor `rest`, or None for
    any other tensor."""
    match = _EXPERT.match(rest)
    if match is None:
        return None
    expert, inner = match.groups()
    grouped = [f"mlp.experts.{inner}{expert}"] if inner.endswith(".weight") else []  # TEGroupedMLP: weight<e>
    return [f"mlp.experts.local_experts.{expert}.{inner}", *grouped]


def _get(ns, name, default=None):
    value = getattr(ns, name, default)
    return default if value is None else value


def moe_fields_from_megatron_args(ns, where: str) -> dict:
    """{'moe': the MoEConfig of a Megatron run's --num-experts and --moe-* arguments} (None:
    dense); refuses, naming the argument, what megalite's experts do not compute."""
    experts = _get(ns, "num_experts")
    if not experts:
        return {"moe": None}
    if _get(ns, "add_bias_linear", True) and not _get(ns, "disable_bias_linear", False):
        raise ConversionError(f"{where}: the checkpoint's model uses add_bias_linear=True with num_experts={experts}: "
                              "megalite's experts have no biases")
    score = _get(ns, "moe_router_score_function", "softmax")
    balancing = _get(ns, "moe_router_load_balancing_type", "aux_loss")
    if isinstance(balancing, list):  # Megatron accepts one type per list entry; megalite computes one
        if len(set(balancing)) != 1:
            raise ConversionError(f"{where}: the checkpoint's model uses moe_router_load_balancing_type={balancing!r}, "
                                  "which megalite does not have (one type)")
        balancing = balancing[0]
    layer_freq = _get(ns, "moe_layer_freq", 1)
    try:
        return {"moe": MoEConfig(
            num_experts=int(experts), ffn_hidden_size=int(_get(ns, "moe_ffn_hidden_size", _get(ns, "ffn_hidden_size"))),
            layer_freq=layer_freq, router_topk=int(_get(ns, "moe_router_topk", 2)), score_function=score,
            pre_softmax=bool(_get(ns, "moe_router_pre_softmax", False)),
            topk_scaling_factor=_get(ns, "moe_router_topk_scaling_factor"), router_dtype=_get(ns, "moe_router_dtype"),
            num_groups=_get(ns, "moe_router_num_groups"), group_topk=_get(ns, "moe_router_group_topk"),
            load_balancing_type=balancing, aux_loss_coeff=_aux_coeff(ns), z_loss_coeff=_get(ns, "moe_z_loss_coeff"),
            enable_expert_bias=bool(_get(ns, "moe_router_enable_expert_bias", False)),
            bias_update_rate=float(_get(ns, "moe_router_bias_update_rate", 1e-3)),
            capacity_factor=_get(ns, "moe_expert_capacity_factor"),
            pad_to_capacity=bool(_get(ns, "moe_pad_expert_input_to_capacity", False)),
            token_drop_policy=_get(ns, "moe_token_drop_policy", "probs"),
            shared_expert_intermediate_size=_get(ns, "moe_shared_expert_intermediate_size"),
            shared_expert_gate=bool(_get(ns, "moe_shared_expert_gate", False)),
            grouped_gemm=bool(_get(ns, "moe_grouped_gemm", False)),
            token_dispatcher_type="alltoall" if _get(ns, "moe_token_dispatcher_type", "allgather") in ("alltoall", "flex")
            else "allgather")}
    except ValueError as e:
        raise ConversionError(f"{where}: the checkpoint's MoE arguments: {e}") from None


def _aux_coeff(ns) -> float:
    coeff = _get(ns, "moe_aux_loss_coeff", 0.0)
    return float(coeff[0] if isinstance(coeff, list) else coeff)
