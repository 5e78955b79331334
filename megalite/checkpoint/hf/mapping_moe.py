"""Map Hugging Face MixtralForCausalLM / Qwen2MoeForCausalLM / Qwen3MoeForCausalLM weights to
megalite's and back.

Names are those of the Hugging Face files (per expert: Mixtral's block_sparse_moe.gate and
experts.e.w1 / w3 / w2, Qwen2-MoE's and Qwen3-MoE's mlp.gate and experts.e.gate_proj / up_proj /
down_proj);
split_fused_experts renames a transformers >= 5 in-memory state dict (fused 3-D experts) to
them. Attention and norms are Llama's (Qwen2-MoE adds q/k/v biases); expert e is megalite's
`mlp.local_experts.e` (linear_fc1 = [gate; up]); Qwen2-MoE's shared expert and its sigmoid
gate map to `mlp.shared_experts`. Qwen3-MoE has no shared expert and no QKV biases but a per-head
RMSNorm on queries and keys (q_norm / k_norm: megalite's qk_layernorm). Mixtral renormalises its
top-k softmax probabilities (megalite's softmax after top-k); Qwen2-MoE and Qwen3-MoE do so only
with norm_topk_prob (else softmax before top-k). Qwen's dense layers (mlp_only_layers, or not a
multiple of decoder_sparse_step counting from 1) are megalite's --moe-layer-freq zeros.
"""

from collections.abc import Iterator

import torch

from megalite.checkpoint.hf.config_fields import cfg as _cfg
from megalite.checkpoint.hf.config_fields import llama_style_fields
from megalite.checkpoint.hf.config_fields import refuse as _refuse
from megalite.model.config import GPTConfig
from megalite.model.moe_config import MoEConfig

MOE_MODEL_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe")


def moe_family_of(config: GPTConfig) -> str | None:
    """'mixtral', 'qwen2_moe' or 'qwen3_moe' for a model with experts ('qwen3_moe' when it has
    qk-norm, 'qwen2_moe' when it has QKV biases or a shared expert), None for a dense one."""
    moe = config.moe
    if moe is None:
        return None
    if (config.normalization, config.activation, config.position_embedding_type, config.add_bias_linear,
            config.rotary_percent) != ("RMSNorm", "swiglu", "rope", False, 1.0):
        _refuse("normalization/activation/positions/biases", (config.normalization, config.activation),
                "RMSNorm, SwiGLU, full RoPE, no linear biases for Mixtral / Qwen2-MoE")
    routing = (moe.score_function, moe.topk_scaling_factor, moe.group_topk, moe.router_dtype, moe.capacity_factor)
    if routing != ("softmax", None, None, None, None) or moe.enable_expert_bias:
        _refuse("router", routing, "softmax top-k routing without scaling, groups, bias or dropping")
    if config.qk_layernorm:
        if config.add_qkv_bias or moe.shared_expert_intermediate_size is not None:
            _refuse("qk_layernorm", True, "qk-norm only without QKV biases and shared experts (Qwen3-MoE)")
        return "qwen3_moe"
    qwen = config.add_qkv_bias or moe.shared_expert_intermediate_size is not None
    if not qwen and (moe.pre_softmax or moe.layer_pattern(config.num_layers) != [1] * config.num_layers):
        _refuse("pre_softmax/layer_freq", (moe.pre_softmax, moe.layer_freq), "top-k then softmax on every layer "
                "for Mixtral")
    if qwen and (not config.add_qkv_bias or not moe.shared_expert_gate or moe.shared_expert_intermediate_size is None):
        _refuse("add_qkv_bias/shared expert", (config.add_qkv_bias, moe.shared_expert_intermediate_size),
                "QKV biases and a gated shared expert for Qwen2-MoE")
    return "qwen2_moe" if qwen else "mixtral"


def config_from_hf_moe(hf_config) -> GPTConfig:
    model_type = _cfg(hf_config, "model_type")
    if _cfg(hf_config, "hidden_act", "silu") != "silu":
        _refuse("hidden_act", _cfg(hf_config, "hidden_act"), "silu")
    if _cfg(hf_config, "sliding_window") is not None and _cfg(hf_config, "use_sliding_window", True):
        _refuse("sliding_window", _cfg(hf_config, "sliding_window"), "None (full attention)")
    for field in ("rope_parameters", "rope_scaling"):
        rope = _cfg(hf_config, field) or {}
        if rope.get("rope_type", rope.get("type", "default")) != "default":
            _refuse(field, rope, "no rope scaling")
    theta = (_cfg(hf_config, "rope_parameters") or {}).get("rope_theta", _cfg(hf_config, "rope_theta", 10000.0))
    layers, heads = _cfg(hf_config, "num_hidden_layers"), _cfg(hf_config, "num_attention_heads")
    if model_type == "mixtral":
        moe = MoEConfig(num_experts=_cfg(hf_config, "num_local_experts"), ffn_hidden_size=_cfg(hf_config, "intermediate_size"),
                        router_topk=_cfg(hf_config, "num_experts_per_tok"))
        qkv_bias = False
    else:
        qwen3 = model_type == "qwen3_moe"
        step, dense = _cfg(hf_config, "decoder_sparse_step", 1), set(_cfg(hf_config, "mlp_only_layers", []))
        # Qwen3MoeConfig maps num_experts to num_local_experts, the name its to_dict writes.
        experts = _cfg(hf_config, "num_experts", _cfg(hf_config, "num_local_experts"))
        if not experts:
            _refuse("num_experts", experts, f"at least 1 for {model_type} (a dense model is 'qwen3' / 'llama')")
        moe = MoEConfig(num_experts=experts, ffn_hidden_size=_cfg(hf_config, "moe_intermediate_size"),
                        router_topk=_cfg(hf_config, "num_experts_per_tok"),
                        pre_softmax=not _cfg(hf_config, "norm_topk_prob", False),
                        layer_freq=[int(i not in dense and (i + 1) % step == 0) for i in range(layers)],
                        shared_expert_intermediate_size=None if qwen3 else _cfg(hf_config, "shared_expert_intermediate_size"),
                        shared_expert_gate=not qwen3)
        if qwen3 and _cfg(hf_config, "attention_bias", False):
            _refuse("attention_bias", True, "False for Qwen3-MoE")
        if not qwen3 and not _cfg(hf_config, "qkv_bias", True):
            _refuse("qkv_bias", False, "True for Qwen2-MoE")
        qkv_bias = not qwen3
    return GPTConfig(
        **llama_style_fields(hf_config, theta), num_query_groups=_cfg(hf_config, "num_key_value_heads", heads),
        kv_channels=_cfg(hf_config, "head_dim"), add_bias_linear=False, add_qkv_bias=qkv_bias, moe=moe,
        qk_layernorm=model_type == "qwen3_moe")


def hf_config_dict_moe(config: GPTConfig) -> dict:
    moe, family = config.moe, moe_family_of(config)
    out = {
        "vocab_size": config.vocab_size, "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups, "head_dim": config.kv_channels,
        "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.norm_epsilon,
        "rope_theta": config.rotary_base, "hidden_act": "silu", "num_experts_per_tok": moe.router_topk,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights, "sliding_window": None,
        "initializer_range": config.init_method_std, "attention_dropout": config.attention_dropout,
        "torch_dtype": config.params_dtype,
    }
    if family == "mixtral":
        if moe.ffn_hidden_size != config.ffn_hidden_size:
            _refuse("moe_ffn_hidden_size", moe.ffn_hidden_size, "ffn_hidden_size for Mixtral")
        return {**out, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                "num_local_experts": moe.num_experts}
    pattern = moe.layer_pattern(config.num_layers)
    out.update(num_experts=moe.num_experts, moe_intermediate_size=moe.ffn_hidden_size, norm_topk_prob=not moe.pre_softmax,
               decoder_sparse_step=1, mlp_only_layers=[i for i, v in enumerate(pattern) if not v], use_sliding_window=False)
    if family == "qwen3_moe":
        return {**out, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "attention_bias": False}
    return {**out, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "qkv_bias": True,
            "shared_expert_intermediate_size": moe.shared_expert_intermediate_size}


def _expert_names(family: str, hf: str, e: int) -> tuple[str, str, str, str]:
    """(router, gate, up, down) tensor names of expert e as the Hugging Face files store them."""
    if family == "mixtral":
        base = f"{hf}block_sparse_moe."
        return (base + "gate.weight", *(f"{base}experts.{e}.{w}.weight" for w in ("w1", "w3", "w2")))
    return (f"{hf}mlp.gate.weight", *(f"{hf}mlp.experts.{e}.{w}_proj.weight" for w in ("gate", "up", "down")))


def split_fused_experts(state_dict: dict, config: GPTConfig, family: str | None = None) -> dict:
    """A transformers (>= 5) in-memory state dict, whose experts are fused 3-D tensors
    (mlp.experts.gate_up_proj [E, 2f, h], mlp.experts.down_proj [E, h, f]), renamed to the
    per-expert tensors Hugging Face files hold (what the mappings read and write)."""
    family, out = family or moe_family_of(config), {}
    for name, tensor in state_dict.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            hf = name[:-len("mlp.experts.gate_up_proj")]
            for e, fused in enumerate(tensor):
                _, gate, up, _ = _expert_names(family, hf, e)
                out[gate], out[up] = fused.chunk(2)
        elif name.endswith("mlp.experts.down_proj"):
            hf = name[:-len("mlp.experts.down_proj")]
            for e, down in enumerate(tensor):
                out[_expert_names(family, hf, e)[3]] = down
        elif family == "mixtral" and name.endswith("mlp.gate.weight"):
            out[_expert_names(family, name[:-len("mlp.gate.weight")], 0)[0]] = tensor
        else:
            out[name] = tensor
    return out


def moe_mlp_to_megalite(get, config: GPTConfig, hf: str, ml: str) -> Iterator[tuple[str, torch.Tensor]]:
    """One layer's MLP tensors (hf / ml: the layer's name prefixes), MoE or dense."""
    moe = config.moe
    if not moe.is_moe_layer(int(ml.split(".")[1]), config.num_layers):
        yield ml + "mlp.linear_fc1.weight", torch.cat([get(hf + "mlp.gate_proj.weight"), get(hf + "mlp.up_proj.weight")])
        yield ml + "mlp.linear_fc2.weight", get(hf + "mlp.down_proj.weight")
        return
    family = moe_family_of(config)
    yield ml + "mlp.router.weight", get(_expert_names(family, hf, 0)[0])
    for e in range(moe.num_experts):
        _, gate, up, down = _expert_names(family, hf, e)
        yield ml + f"mlp.local_experts.{e}.linear_fc1.weight", torch.cat([get(gate), get(up)])
        yield ml + f"mlp.local_experts.{e}.linear_fc2.weight", get(down)
    if moe.shared_expert_intermediate_size:
        sh = hf + "mlp.shared_expert."
        yield ml + "mlp.shared_experts.linear_fc1.weight", torch.cat([get(sh + "gate_proj.weight"),
                                                                      get(sh + "up_proj.weight")])
        yield ml + "mlp.shared_experts.linear_fc2.weight", get(sh + "down_proj.weight")
        yield ml + "mlp.shared_experts.gate_weight", get(hf + "mlp.shared_expert_gate.weight")


def moe_mlp_to_hf(get, config: GPTConfig, hf: str, ml: str) -> Iterator[tuple[str, torch.Tensor]]:
    moe = config.moe
    if not moe.is_moe_layer(int(ml.split(".")[1]), config.num_layers):
        gate, up = get(ml + "mlp.linear_fc1.weight").chunk(2)
        yield hf + "mlp.gate_proj.weight", gate.contiguous()
        yield hf + "mlp.up_proj.weight", up.contiguous()
        yield hf + "mlp.down_proj.weight", get(ml + "mlp.linear_fc2.weight")
        return
    family = moe_family_of(config)
    yield _expert_names(family, hf, 0)[0], get(ml + "mlp.router.weight")
    for e in range(moe.num_experts):
        _, gate_name, up_name, down_name = _expert_names(family, hf, e)
        gate, up = get(ml + f"mlp.local_experts.{e}.linear_fc1.weight").chunk(2)
        yield gate_name, gate.contiguous()
        yield up_name, up.contiguous()
        yield down_name, get(ml + f"mlp.local_experts.{e}.linear_fc2.weight")
    if moe.shared_expert_intermediate_size:
        sh = hf + "mlp.shared_expert."
        gate, up = get(ml + "mlp.shared_experts.linear_fc1.weight").chunk(2)
        yield sh + "gate_proj.weight", gate.contiguous()
        yield sh + "up_proj.weight", up.contiguous()
        yield sh + "down_proj.weight", get(ml + "mlp.shared_experts.linear_fc2.weight")
        yield hf + "mlp.shared_expert_gate.weight", get(ml + "mlp.shared_experts.gate_weight")
