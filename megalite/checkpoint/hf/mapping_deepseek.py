"""Map Hugging Face DeepseekV3ForCausalLM weights (DeepSeek-V3, Kimi K2 and their kin) to
megalite's and back.

Attention is multi-latent (megalite's --multi-latent-attention with --qk-layernorm):

    q_proj | q_a_proj, q_a_layernorm, q_b_proj     linear_q_proj | linear_q_down_proj, q_layernorm, linear_q_up_proj
    kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj  linear_kv_down_proj, kv_layernorm, linear_kv_up_proj
    o_proj                                         linear_proj

with the same per-head row layouts on both sides ([q_nope; q_rope] per head, [k_nope; v] per
head) and rope_interleave's channel order (Megatron's). The first first_k_dense_replace layers
have a dense MLP, the others DeepSeek's MoE: sigmoid scores, e_score_correction_bias (megalite's
router.expert_bias), group-limited top-k, normalised and scaled by routed_scaling_factor, and
n_shared_experts x moe_intermediate_size of shared expert. YaRN rope_parameters become the MLA
rotary settings.

Multi-token prediction: DeepSeek-V3's files hold depth k as layer num_hidden_layers + k (a decoder
layer plus enorm, hnorm, eh_proj, shared_head.norm and copies of the embedding and head, which
megalite shares with the model); transformers' class ignores those tensors. megalite's
mtp.layers.k maps to them where the files have them (hf.reader drops num_nextn_predict_layers
where they do not).
"""

from collections.abc import Iterator

import torch

from megalite.checkpoint.hf.config_fields import cfg as _cfg
from megalite.checkpoint.hf.config_fields import llama_style_fields
from megalite.checkpoint.hf.config_fields import refuse as _refuse
from megalite.model.config import GPTConfig
from megalite.model.mla_config import MLAConfig
from megalite.model.moe_config import MoEConfig

MODEL_TYPE = "deepseek_v3"
_ATTENTION = (("linear_q_proj", "q_proj"), ("linear_q_down_proj", "q_a_proj"), ("q_layernorm", "q_a_layernorm"),
              ("linear_q_up_proj", "q_b_proj"), ("linear_kv_down_proj", "kv_a_proj_with_mqa"),
              ("kv_layernorm", "kv_a_layernorm"), ("linear_kv_up_proj", "kv_b_proj"), ("linear_proj", "o_proj"))
_MTP = (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("final_layernorm", "shared_head.norm"))


def _mla_from_hf(hf_config) -> MLAConfig:
    rope = dict(_cfg(hf_config, "rope_parameters") or _cfg(hf_config, "rope_scaling") or {})
    kind = rope.get("rope_type", rope.get("type", "default"))
    shape = dict(q_lora_rank=_cfg(hf_config, "q_lora_rank"), kv_lora_rank=_cfg(hf_config, "kv_lora_rank"),
                 qk_head_dim=_cfg(hf_config, "qk_nope_head_dim"), qk_pos_emb_head_dim=_cfg(hf_config, "qk_rope_head_dim"),
                 v_head_dim=_cfg(hf_config, "v_head_dim"))
    if kind == "default":
        return MLAConfig(**shape, rope_type="rope")
    if kind != "yarn":
        _refuse("rope_parameters.rope_type", kind, "'default' or 'yarn'")
    if rope.get("attention_factor") is not None:
        _refuse("rope_parameters.attention_factor", rope["attention_factor"], "None (derived from mscale, as DeepSeek)")
    original = rope.get("original_max_position_embeddings")
    factor = rope.get("factor") or _cfg(hf_config, "max_position_embeddings") / original
    mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
    if all_dim and not mscale:  # transformers: cos/sin get mscale(factor), the softmax mscale_all_dim's
        _refuse("rope_parameters.mscale", mscale, "a non-zero mscale beside mscale_all_dim")
    if not all_dim:
        mscale, all_dim = 1.0, 0.0  # transformers then ignores mscale
    return MLAConfig(**shape, rope_type="yarn", rotary_scaling_factor=float(factor),
                     original_max_position_embeddings=int(original), beta_fast=float(rope.get("beta_fast", 32)),
                     beta_slow=float(rope.get("beta_slow", 1)), mscale=float(mscale), mscale_all_dim=float(all_dim),
                     correction_range_round_to_int=bool(rope.get("truncate", True)))


def _moe_from_hf(hf_config, layers: int) -> MoEConfig | None:
    dense = _cfg(hf_config, "first_k_dense_replace", 0)
    experts = _cfg(hf_config, "n_routed_experts", _cfg(hf_config, "num_local_experts"))
    if not experts or dense >= layers:
        return None
    topk, groups, group_topk = (_cfg(hf_config, n) for n in ("num_experts_per_tok", "n_group", "topk_group"))
    if _cfg(hf_config, "norm_topk_prob", True) != (topk > 1):
        _refuse("norm_topk_prob", _cfg(hf_config, "norm_topk_prob"), "True with several experts per token, False "
                "with one (Megatron's sigmoid routing)")
    if groups and groups > 1 and topk != 2 * group_topk:
        # transformers scores a group by its best two experts, Megatron by its best topk / topk_group
        _refuse("num_experts_per_tok/topk_group", (topk, group_topk), "num_experts_per_tok = 2 x topk_group")
    shared = _cfg(hf_config, "n_shared_experts", 0)
    return MoEConfig(num_experts=experts, ffn_hidden_size=_cfg(hf_config, "moe_intermediate_size"), router_topk=topk,
                     layer_freq=[0] * dense + [1] * (layers - dense), score_function="sigmoid",
                     topk_scaling_factor=float(_cfg(hf_config, "routed_scaling_factor", 1.0)), router_dtype="fp32",
                     num_groups=groups if groups and groups > 1 else None,
                     group_topk=group_topk if groups and groups > 1 else None, enable_expert_bias=True,
                     shared_expert_intermediate_size=shared * _cfg(hf_config, "moe_intermediate_size") or None)


def config_from_hf_deepseek(hf_config) -> GPTConfig:
    """A GPTConfig from a DeepseekV3Config (object or config.json dict)."""
    for field, expected in (("hidden_act", "silu"), ("attention_bias", False), ("rope_interleave", True),
                            ("pretraining_tp", 1)):
        if _cfg(hf_config, field, expected) != expected:
            _refuse(field, _cfg(hf_config, field), repr(expected))
    layers = _cfg(hf_config, "num_hidden_layers")
    rope = _cfg(hf_config, "rope_parameters") or {}
    theta = rope.get("rope_theta", _cfg(hf_config, "rope_theta", 10000.0))
    return GPTConfig(
        **llama_style_fields(hf_config, theta), add_bias_linear=False, qk_layernorm=True,
        mla=_mla_from_hf(hf_config), moe=_moe_from_hf(hf_config, layers),
        mtp_num_layers=_cfg(hf_config, "num_nextn_predict_layers", _cfg(hf_config, "num_mtp_layers", 0)) or None)


def check_deepseek(config: GPTConfig) -> None:
    """Refuse a megalite model DeepseekV3ForCausalLM cannot hold, naming the field."""
    shape = (config.normalization, config.activation, config.add_bias_linear, config.qk_layernorm,
             config.position_embedding_type)
    if shape != ("RMSNorm", "swiglu", False, True, "rope"):
        _refuse("normalization/activation/biases/qk_layernorm/positions", shape,
                "RMSNorm, SwiGLU, no biases, the latent norms (qk_layernorm) and no position table for DeepSeek-V3")
    if config.mla.rope_type == "rope" and config.rotary_percent != 1.0:
        _refuse("rotary_percent", config.rotary_percent, "1.0")
    moe = config.moe
    if moe is None:
        return
    pattern = moe.layer_pattern(config.num_layers)
    dense = pattern.index(1) if 1 in pattern else config.num_layers
    if pattern != [0] * dense + [1] * (config.num_layers - dense):
        _refuse("moe.layer_freq", moe.layer_freq, "dense layers first, then experts (first_k_dense_replace)")
    routing = (moe.score_function, moe.enable_expert_bias, moe.pre_softmax, moe.capacity_factor, moe.shared_expert_gate)
    if routing != ("sigmoid", True, False, None, False):
        _refuse("router", routing, "sigmoid scores with expert bias, no dropping, an ungated shared expert")
    if moe.group_topk and moe.router_topk != 2 * moe.group_topk:
        _refuse("router_topk/group_topk", (moe.router_topk, moe.group_topk), "router_topk = 2 x group_topk")
    shared = moe.shared_expert_intermediate_size or 0
    if shared % moe.ffn_hidden_size:
        _refuse("shared_expert_intermediate_size", shared, "a multiple of the expert width")


def hf_config_dict_deepseek(config: GPTConfig) -> dict:
    check_deepseek(config)
    mla, moe = config.mla, config.moe
    dense = config.num_layers if moe is None else moe.layer_pattern(config.num_layers).index(1)
    rope = {"rope_type": "default", "rope_theta": config.rotary_base}
    if mla.rope_type == "yarn":
        rope.update(rope_type="yarn", factor=mla.rotary_scaling_factor, beta_fast=mla.beta_fast, beta_slow=mla.beta_slow,
                    mscale=mla.mscale, mscale_all_dim=mla.mscale_all_dim, truncate=mla.correction_range_round_to_int,
                    original_max_position_embeddings=mla.original_max_position_embeddings)
    out = {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": MODEL_TYPE, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_attention_heads, "q_lora_rank": mla.q_lora_rank,
        "kv_lora_rank": mla.kv_lora_rank, "qk_nope_head_dim": mla.qk_head_dim, "qk_rope_head_dim": mla.qk_pos_emb_head_dim,
        "v_head_dim": mla.v_head_dim, "rope_parameters": rope, "rope_interleave": True, "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.norm_epsilon,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights, "attention_bias": False,
        "initializer_range": config.init_method_std, "attention_dropout": config.attention_dropout,
        "first_k_dense_replace": dense, "num_nextn_predict_layers": config.mtp_num_layers or 0,
        "torch_dtype": config.params_dtype,
    }
    if moe is not None:
        out.update(n_routed_experts=moe.num_experts, moe_intermediate_size=moe.ffn_hidden_size,
                   num_experts_per_tok=moe.router_topk, n_group=moe.num_groups or 1, topk_group=moe.group_topk or 1,
                   norm_topk_prob=moe.router_topk > 1, routed_scaling_factor=moe.topk_scaling_factor or 1.0,
                   n_shared_experts=(moe.shared_expert_intermediate_size or 0) // moe.ffn_hidden_size)
    return out


def _layer_pairs(config: GPTConfig, layers, post_process: bool):
    """(Hugging Face prefix, megalite prefix, megalite layer number) of the decoder layers and,
    on the last stage, of each MTP depth's transformer layer."""
    for i in layers:
        yield f"model.layers.{i}.", f"layers.{i}.", i
    if post_process:
        for k in range(config.mtp_num_layers or 0):
            yield f"model.layers.{config.num_layers + k}.", f"mtp.layers.{k}.mtp_model_layer.", config.num_layers + k


def _mlp_names(config: GPTConfig, number: int):
    """(megalite suffix, [Hugging Face suffixes]) of one layer's MLP: a fused [gate; up] row for fc1."""
    moe = config.moe
    if moe is None or not moe.is_moe_layer(number, config.num_layers):
        yield "mlp.linear_fc1.weight", ["mlp.gate_proj.weight", "mlp.up_proj.weight"]
        yield "mlp.linear_fc2.weight", ["mlp.down_proj.weight"]
        return
    yield "mlp.router.weight", ["mlp.gate.weight"]
    yield "mlp.router.expert_bias", ["mlp.gate.e_score_correction_bias"]
    for e in range(moe.num_experts):
        yield f"mlp.local_experts.{e}.linear_fc1.weight", [f"mlp.experts.{e}.gate_proj.weight",
                                                           f"mlp.experts.{e}.up_proj.weight"]
        yield f"mlp.local_experts.{e}.linear_fc2.weight", [f"mlp.experts.{e}.down_proj.weight"]
    if moe.shared_expert_intermediate_size:
        yield "mlp.shared_experts.linear_fc1.weight", ["mlp.shared_experts.gate_proj.weight",
                                                       "mlp.shared_experts.up_proj.weight"]
        yield "mlp.shared_experts.linear_fc2.weight", ["mlp.shared_experts.down_proj.weight"]


def _layer_names(config: GPTConfig, number: int):
    for ml, hf in (("input_layernorm", "input_layernorm"), ("pre_mlp_layernorm", "post_attention_layernorm")):
        yield f"{ml}.weight", [f"{hf}.weight"]
    q_lora = config.mla.q_lora_rank is not None
    for ml, hf in _ATTENTION:
        if (ml == "linear_q_proj" and q_lora) or (ml in ("linear_q_down_proj", "q_layernorm", "linear_q_up_proj")
                                                  and not q_lora):
            continue
        yield f"self_attention.{ml}.weight", [f"self_attn.{hf}.weight"]
    yield from _mlp_names(config, number)


def deepseek_to_megalite(get, config: GPTConfig, padded_vocab: int | None, layers, pre_process: bool,
                         post_process: bool, pad_rows) -> Iterator[tuple[str, torch.Tensor]]:
    if pre_process:
        yield "embedding.word_embeddings.weight", pad_rows(get("model.embed_tokens.weight"), padded_vocab)
    for hf, ml, number in _layer_pairs(config, layers, post_process):
        for ml_name, hf_names in _layer_names(config, number):
            yield ml + ml_name, torch.cat([get(hf + n) for n in hf_names]) if len(hf_names) > 1 else get(hf + hf_names[0])
    if post_process:
        for k in range(config.mtp_num_layers or 0):
            hf = f"model.layers.{config.num_layers + k}."
            for ml_name, hf_name in _MTP:
                yield f"mtp.layers.{k}.{ml_name}.weight", get(f"{hf}{hf_name}.weight")
        yield "final_layernorm.weight", get("model.norm.weight")
        if config.untie_embeddings_and_output_weights:
            yield "output_layer.weight", pad_rows(get("lm_head.weight"), padded_vocab)


def megalite_to_deepseek(get, config: GPTConfig, layers, pre_process: bool,
                         post_process: bool) -> Iterator[tuple[str, torch.Tensor]]:
    vocab = config.vocab_size
    if pre_process:
        yield "model.embed_tokens.weight", get("embedding.word_embeddings.weight")[:vocab]
    for hf, ml, number in _layer_pairs(config, layers, post_process):
        for ml_name, hf_names in _layer_names(config, number):
            value = get(ml + ml_name)
            for hf_name, part in zip(hf_names, value.chunk(len(hf_names))):
                yield hf + hf_name, part.contiguous()
    if post_process:
        head = "output_layer.weight" if config.untie_embeddings_and_output_weights else "embedding.word_embeddings.weight"
        for k in range(config.mtp_num_layers or 0):
            hf = f"model.layers.{config.num_layers + k}."
            for ml_name, hf_name in _MTP:
                yield f"{hf}{hf_name}.weight", get(f"mtp.layers.{k}.{ml_name}.weight")
            # DeepSeek-V3's files repeat the shared embedding and head in every MTP layer
            yield hf + "embed_tokens.weight", get("embedding.word_embeddings.weight")[:vocab].clone()
            yield hf + "shared_head.head.weight", get(head)[:vocab].clone()
        yield "model.norm.weight", get("final_layernorm.weight")
        if config.untie_embeddings_and_output_weights:
            yield "lm_head.weight", get("output_layer.weight")[:vocab]


def split_fused_deepseek_experts(state_dict: dict) -> dict:
    """transformers' in-memory DeepSeek-V3 state dict (fused 3-D experts) under the per-expert
    names its files hold."""
    out = {}
    for name, tensor in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[:-len("gate_up_proj")]
            for e, fused in enumerate(tensor):
                out[f"{base}{e}.gate_proj.weight"], out[f"{base}{e}.up_proj.weight"] = fused.chunk(2)
        elif name.endswith("mlp.experts.down_proj"):
            base = name[:-len("down_proj")]
            for e, down in enumerate(tensor):
                out[f"{base}{e}.down_proj.weight"] = down
        else:
            out[name] = tensor
    return out
