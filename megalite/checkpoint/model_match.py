"""--load of a megalite checkpoint into a run whose model arguments differ from the ones it was
trained with. A changed shape fails at the tensor anyway; a change that keeps every shape (the
heads of the same width, the normalization's epsilon, biases the kernels ignore, the routing of
the same experts) would load silently and compute another function of the same weights. Megatron
compares a few arguments on load (check_checkpoint_args: layers, hidden size, heads, position
embedding, and with a vocabulary file the vocabulary); megalite compares every field of the
stored model_config that defines what the weights compute, naming the flag, before any tensor is
read. --load of a Megatron checkpoint (megalite.checkpoint.run_load) compares the GPTConfig its
stored args describe (megalite.checkpoint.megatron.args) the same way.

The fields a context extension changes on purpose (rotary base and scaling, positions, MTP depth)
are noted, not refused; under --finetune or --pretrained-checkpoint (a new run from these
weights, where Megatron compares nothing) every difference is noted.
"""

import json
from dataclasses import asdict

from megalite.checkpoint.dcp.checkpoint import published_iteration_dir, read_tracker
from megalite.checkpoint.dcp.format import CheckpointError
from megalite.model.config import GPTConfig

# GPTConfig fields whose change reinterprets the weights, with the flag that sets each
ARCHITECTURE = {
    "num_layers": "--num-layers", "hidden_size": "--hidden-size", "num_attention_heads": "--num-attention-heads",
    "num_query_groups": "--num-query-groups", "kv_channels": "--kv-channels", "ffn_hidden_size": "--ffn-hidden-size",
    "vocab_size": "the tokenizer (--tokenizer-type, --vocab-size / --vocab-file)",
    "position_embedding_type": "--position-embedding-type", "rotary_percent": "--rotary-percent",
    "rotary_interleaved": "--rotary-interleaved", "normalization": "--normalization",
    "norm_epsilon": "--norm-epsilon", "apply_layernorm_1p": "--apply-layernorm-1p", "qk_layernorm": "--qk-layernorm",
    "activation": "--swiglu / --squared-relu / --openai-gelu / --no-bias-gelu-fusion", "add_bias_linear": "--disable-bias-linear",
    "add_qkv_bias": "--add-qkv-bias", "untie_embeddings_and_output_weights": "--untie-embeddings-and-output-weights",
    "softmax_scale": "--mup-base-head-dim / --mup-attn-scale-power", "use_mup": "--use-mup",
    "mup_width_mult": "--mup-base-hidden-size", "mup_embedding_mult": "--mup-embedding-mult",
    "mup_output_mult": "--mup-output-mult",
}
MOE_ARCHITECTURE = {
    "num_experts": "--num-experts", "ffn_hidden_size": "--moe-ffn-hidden-size", "layer_freq": "--moe-layer-freq",
    "router_topk": "--moe-router-topk", "score_function": "--moe-router-score-function",
    "pre_softmax": "--moe-router-pre-softmax", "topk_scaling_factor": "--moe-router-topk-scaling-factor",
    "num_groups": "--moe-router-num-groups", "group_topk": "--moe-router-group-topk",
    "enable_expert_bias": "--moe-router-enable-expert-bias",
    "shared_expert_intermediate_size": "--moe-shared-expert-intermediate-size",
    "shared_expert_gate": "--moe-shared-expert-gate",
}
MLA_ARCHITECTURE = {
    "q_lora_rank": "--q-lora-rank", "kv_lora_rank": "--kv-lora-rank", "qk_head_dim": "--qk-head-dim",
    "qk_pos_emb_head_dim": "--qk-pos-emb-head-dim", "v_head_dim": "--v-head-dim",
}
# changed on purpose to extend the context or drop the MTP depths: noted
CONTEXT_EXTENSION = {
    "rotary_base": "--rotary-base", "rotary_seq_len_interpolation_factor": "--rotary-seq-len-interpolation-factor",
    "use_rope_scaling": "--use-rope-scaling", "rope_scaling_factor": "--rope-scaling-factor",
    "mtp_num_layers": "--mtp-num-layers",
}


def stored_model_config(load_dir, iteration: int | None) -> dict | None:
    """The model_config in the common.json of the checkpoint --load reads; None where there is
    none or it cannot be read (the load that follows names what is wrong)."""
    try:
        iteration = read_tracker(load_dir) if iteration is None else iteration
        common = json.loads((published_iteration_dir(load_dir, iteration) / "common.json").read_text())
    except (OSError, ValueError, TypeError, CheckpointError):
        return None
    return common.get("model_config") if isinstance(common, dict) else None


def _plain(value):
    """JSON's view of a value (tuples as lists), as common.json stores it."""
    return json.loads(json.dumps(value))


def _sections(config: dict) -> list[tuple[str, dict, dict]]:
    """(prefix, fields to flags, values) for the model and its MoE and MLA parts."""
    sections = [("", {**ARCHITECTURE, **CONTEXT_EXTENSION}, config)]
    for key, table in (("moe", MOE_ARCHITECTURE), ("mla", MLA_ARCHITECTURE)):
        sections.append((f"{key}.", table, config.get(key) or {}))
    return sections


def _effective(config: dict) -> dict:
    """The values the model computes with: the QKV projection has a bias whenever every linear
    layer has one (Megatron's validate_args sets add_qkv_bias then, megalite's flags leave it),
    and multi-latent attention scales scores by its own softmax scale, never softmax_scale."""
    config = dict(config)
    if config.get("add_bias_linear") and "add_qkv_bias" in config:
        config["add_qkv_bias"] = True
    if config.get("mla") is not None:
        config.pop("softmax_scale", None)
    return config


def model_differences(stored: dict, config: GPTConfig) -> list[tuple[str, str, object, object, bool]]:
    """(field, flag, stored value, this run's value, refused) for each model field that differs
    between a checkpoint's stored model_config (megalite's common.json, or the GPTConfig of a
    Megatron checkpoint's args) and this run's; a field the checkpoint does not store (written
    before it existed) is not compared."""
    stored, run = _effective(stored), _effective(_plain(asdict(config)))
    found = []
    for key, kind in (("moe", "MoE"), ("mla", "multi-latent attention")):
        if (stored.get(key) is None) != (run.get(key) is None):
            has = "the checkpoint" if stored.get(key) is not None else "this run"
            found.append((key, f"{kind} ({has} has it)", stored.get(key) is not None, run.get(key) is not None, True))
    stored_sections = {prefix: values for prefix, _, values in _sections(stored)}
    for prefix, table, values in _sections(run):
        old = stored_sections[prefix]
        if not old or not values:
            continue
        for name, flag in table.items():
            if name in old and name in values and old[name] != values[name]:
                refused = prefix != "" or name not in CONTEXT_EXTENSION
                found.append((prefix + name, flag, old[name], values[name], refused))
    return found


def check_model_matches(stored: dict | None, config: GPTConfig, where, new_run: bool) -> list[str]:
    """Refuse (CheckpointError, one line) a resume whose model differs from the checkpoint's in a
    field that reinterprets the weights; the lines to print for the differences allowed (all of
    them when `new_run`: --finetune or --pretrained-checkpoint)."""
    if not isinstance(stored, dict):
        return []
    differences = model_differences(stored, config)
    refused = [d for d in differences if d[4] and not new_run]
    if refused:
        name, flag, old, new, _ = refused[0]
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise CheckpointError(
            f"--load {where}: the checkpoint's model has {name}={old!r} but this run's has {new!r} ({flag}){more}: "
            "its weights would compute another model; give the checkpoint's value, or --finetune to start a new "
            "run from these weights")
    why = "a new run from these weights" if new_run else "allowed on resume"
    return [f"--load {where}: {name} was {old!r} in the checkpoint, {new!r} in this run ({flag}; {why})"
            for name, flag, old, new, _ in differences]
