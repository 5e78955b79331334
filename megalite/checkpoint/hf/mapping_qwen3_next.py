"""Map Hugging Face Qwen3NextForCausalLM weights to megalite's and back.

Qwen3-Next is megalite's Gated DeltaNet hybrid (GPTConfig.gdn, Megatron's --experimental-attention-variant
gdn) with gated full attention (attention_output_gate), qk-norm, partial rotary (rotary_percent =
partial_rotary_factor) and zero-centred RMSNorms (weight stored as w - 1: --apply-layernorm-1p), and
optionally a fine-grained MoE whose shared expert has a sigmoid gate (Qwen2-MoE's names).

Layouts that differ:
- linear_attn.in_proj_qkvz holds per key head [q dk, k dk, v r*dv, z r*dv] and in_proj_ba per key head
  [b r, a r] (r value heads per key head); megalite's (Megatron's) in_proj.weight is the blocks
  [q, k, v, z, b, a] each over all heads.
- linear_attn.norm (Qwen3NextRMSNormGated) stores w itself, megalite's out_norm w - 1 (exact for
  0.5 <= w <= 2, Sterbenz; a weight outside that range loses its low bits on the way).
- self_attn.q_proj holds per head [query hd, gate hd]; megalite's linear_qkv per query group
  [query heads, gate heads, k, v].
"""

from collections.abc import Iterator

import torch

from megalite.checkpoint.hf.config_fields import cfg as _cfg
from megalite.checkpoint.hf.config_fields import llama_style_fields
from megalite.checkpoint.hf.config_fields import refuse as _refuse
from megalite.model.config import GPTConfig
from megalite.model.gdn_config import GDNConfig
from megalite.model.moe_config import MoEConfig

MODEL_TYPE = "qwen3_next"


def check_qwen3_next(config: GPTConfig) -> None:
    """Refuse, in one line, a Gated DeltaNet / gated-attention model Qwen3NextForCausalLM cannot hold."""
    wanted = dict(gdn=True, attention_output_gate=True, qk_layernorm=True, apply_layernorm_1p=True,
                  normalization="RMSNorm", activation="swiglu", position_embedding_type="rope",
                  add_bias_linear=False, add_qkv_bias=False, rotary_interleaved=False, mla=None, mtp_num_layers=None)
    have = {k: (config.gdn is not None if k == "gdn" else getattr(config, k)) for k in wanted}
    have["mtp_num_layers"] = have["mtp_num_layers"] or None
    wrong = {k: v for k, v in have.items() if v != wanted[k]}
    if wrong:
        _refuse("/".join(wrong), tuple(wrong.values()), "Qwen3-Next's form: " + ", ".join(f"{k}={wanted[k]!r}" for k in wrong))
    if config.use_rope_scaling or config.rotary_seq_len_interpolation_factor is not None:
        _refuse("use_rope_scaling/rotary_seq_len_interpolation_factor", True, "no rope scaling for Qwen3-Next")
    moe = config.moe
    if moe is not None:
        routing = (moe.score_function, moe.topk_scaling_factor, moe.group_topk, moe.router_dtype, moe.capacity_factor)
        if routing != ("softmax", None, None, None, None) or moe.enable_expert_bias:
            _refuse("router", routing, "softmax top-k routing without scaling, groups, bias or dropping")
        if not moe.shared_expert_intermediate_size or not moe.shared_expert_gate:
            _refuse("shared expert", (moe.shared_expert_intermediate_size, moe.shared_expert_gate),
                    "a shared expert with its sigmoid gate (Qwen3-Next)")


def _layer_types(config: GPTConfig) -> list[str]:
    return ["linear_attention" if v else "full_attention" for v in config.gdn.layer_pattern(config.num_layers)]


def config_from_hf_qwen3_next(hf_config) -> GPTConfig:
    if _cfg(hf_config, "hidden_act", "silu") != "silu":
        _refuse("hidden_act", _cfg(hf_config, "hidden_act"), "silu")
    if _cfg(hf_config, "attention_bias", False):
        _refuse("attention_bias", True, "False for Qwen3-Next")
    rope = dict(_cfg(hf_config, "rope_parameters") or _cfg(hf_config, "rope_scaling") or {})
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        _refuse("rope_parameters", rope, "no rope scaling")
    theta = rope.get("rope_theta", _cfg(hf_config, "rope_theta", 10000.0))
    partial = float(rope.get("partial_rotary_factor", _cfg(hf_config, "partial_rotary_factor", 0.25)))
    layers, heads = _cfg(hf_config, "num_hidden_layers"), _cfg(hf_config, "num_attention_heads")
    types = list(_cfg(hf_config, "layer_types"))
    if set(types) - {"linear_attention", "full_attention"} or len(types) != layers:
        _refuse("layer_types", types, f"{layers} entries of 'linear_attention' / 'full_attention'")
    pattern = tuple(int(t == "linear_attention") for t in types)
    intervals = [n for n in range(1, layers + 2) if GDNConfig(linear_attention_freq=n).layer_pattern(layers) == pattern]
    gdn = GDNConfig(linear_attention_freq=intervals[0] if intervals else pattern,
                    **{k: _cfg(hf_config, k) for k in ("linear_conv_kernel_dim", "linear_key_head_dim",
                                                       "linear_value_head_dim", "linear_num_key_heads",
                                                       "linear_num_value_heads")})
    moe = None
    if _cfg(hf_config, "num_experts", 0):
        step, dense = _cfg(hf_config, "decoder_sparse_step", 1), set(_cfg(hf_config, "mlp_only_layers", []))
        moe = MoEConfig(num_experts=_cfg(hf_config, "num_experts"), ffn_hidden_size=_cfg(hf_config, "moe_intermediate_size"),
                        router_topk=_cfg(hf_config, "num_experts_per_tok"),
                        pre_softmax=not _cfg(hf_config, "norm_topk_prob", True),
                        layer_freq=[int(i not in dense and (i + 1) % step == 0) for i in range(layers)],
                        shared_expert_intermediate_size=_cfg(hf_config, "shared_expert_intermediate_size"),
                        shared_expert_gate=True)
    return GPTConfig(**llama_style_fields(hf_config, theta), num_query_groups=_cfg(hf_config, "num_key_value_heads", heads),
                     kv_channels=_cfg(hf_config, "head_dim"), add_bias_linear=False, qk_layernorm=True,
                     apply_layernorm_1p=True, attention_output_gate=True, rotary_percent=partial, gdn=gdn, moe=moe)


def hf_config_dict_qwen3_next(config: GPTConfig) -> dict:
    gdn, moe = config.gdn, config.moe
    out = {
        "architectures": ["Qwen3NextForCausalLM"], "model_type": MODEL_TYPE, "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups, "head_dim": config.kv_channels,
        "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.norm_epsilon,
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rotary_base,
                            "partial_rotary_factor": config.rotary_percent},
        "hidden_act": "silu", "attention_bias": False, "layer_types": _layer_types(config),
        "linear_conv_kernel_dim": gdn.linear_conv_kernel_dim, "linear_key_head_dim": gdn.linear_key_head_dim,
        "linear_value_head_dim": gdn.linear_value_head_dim, "linear_num_key_heads": gdn.linear_num_key_heads,
        "linear_num_value_heads": gdn.linear_num_value_heads,
        "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "initializer_range": config.init_method_std, "attention_dropout": config.attention_dropout,
        "torch_dtype": config.params_dtype, "num_experts": 0,
    }
    if moe is not None:
        pattern = moe.layer_pattern(config.num_layers)
        out.update(num_experts=moe.num_experts, moe_intermediate_size=moe.ffn_hidden_size,
                   num_experts_per_tok=moe.router_topk, norm_topk_prob=not moe.pre_softmax, decoder_sparse_step=1,
                   mlp_only_layers=[i for i, v in enumerate(pattern) if not v],
                   shared_expert_intermediate_size=moe.shared_expert_intermediate_size)
    return out


def _gdn_blocks(config: GPTConfig):
    g = config.gdn
    nk, r = g.linear_num_key_heads, g.linear_num_value_heads // g.linear_num_key_heads
    return nk, r, g.linear_key_head_dim, g.linear_value_head_dim


def _in_proj_to_megalite(qkvz: torch.Tensor, ba: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    nk, r, dk, dv = _gdn_blocks(config)
    h = qkvz.shape[1]
    q, k, v, z = qkvz.reshape(nk, -1, h).split([dk, dk, r * dv, r * dv], dim=1)
    b, a = ba.reshape(nk, 2 * r, h).split([r, r], dim=1)
    return torch.cat([t.reshape(-1, h) for t in (q, k, v, z, b, a)])


def _in_proj_from_megalite(in_proj: torch.Tensor, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor]:
    nk, r, dk, dv = _gdn_blocks(config)
    h = in_proj.shape[1]
    q, k, v, z, b, a = (t.reshape(nk, -1, h) for t in in_proj.split(config.gdn.in_proj_sections()))
    return torch.cat([q, k, v, z], dim=1).reshape(-1, h), torch.cat([b, a], dim=1).reshape(-1, h)


def _qkv_to_megalite(q_gate, k, v, config: GPTConfig) -> torch.Tensor:
    """q_proj (per head [query, gate]), k_proj, v_proj -> per group [queries, gates, k, v]."""
    g, d, h = config.num_query_groups, config.kv_channels, q_gate.shape[1]
    per_group = q_gate.reshape(g, -1, 2, d, h)
    query, gate = per_group[:, :, 0], per_group[:, :, 1]
    return torch.cat([query, gate, k.reshape(g, 1, d, h), v.reshape(g, 1, d, h)], dim=1).reshape(-1, h)


def _qkv_from_megalite(qkv, config: GPTConfig):
    g, d, h = config.num_query_groups, config.kv_channels, qkv.shape[1]
    per_group = config.num_attention_heads // g
    grouped = qkv.reshape(g, 2 * per_group + 2, d, h)
    q_gate = torch.stack([grouped[:, :per_group], grouped[:, per_group:2 * per_group]], dim=2)
    return (q_gate.reshape(-1, h), grouped[:, 2 * per_group].reshape(-1, h).contiguous(),
            grouped[:, 2 * per_group + 1].reshape(-1, h).contiguous())


def _mlp_pairs(config: GPTConfig, hf: str, ml: str, layer: int) -> list:
    """(megalite name, Hugging Face names joined along dim 0) of one layer's MLP."""
    if config.moe is None or not config.moe.is_moe_layer(layer, config.num_layers):
        return [(ml + "mlp.linear_fc1.weight", [hf + "mlp.gate_proj.weight", hf + "mlp.up_proj.weight"]),
                (ml + "mlp.linear_fc2.weight", [hf + "mlp.down_proj.weight"])]
    pairs = [(ml + "mlp.router.weight", [hf + "mlp.gate.weight"])]
    for e in range(config.moe.num_experts):
        ex = f"{hf}mlp.experts.{e}."
        pairs += [(ml + f"mlp.local_experts.{e}.linear_fc1.weight", [ex + "gate_proj.weight", ex + "up_proj.weight"]),
                  (ml + f"mlp.local_experts.{e}.linear_fc2.weight", [ex + "down_proj.weight"])]
    sh = hf + "mlp.shared_expert."
    return pairs + [(ml + "mlp.shared_experts.linear_fc1.weight", [sh + "gate_proj.weight", sh + "up_proj.weight"]),
                    (ml + "mlp.shared_experts.linear_fc2.weight", [sh + "down_proj.weight"]),
                    (ml + "mlp.shared_experts.gate_weight", [hf + "mlp.shared_expert_gate.weight"])]


def _direct_pairs(config: GPTConfig, hf: str, ml: str, layer: int) -> list:
    """(megalite name, Hugging Face name) of the tensors copied as they are."""
    pairs = [(ml + "input_layernorm.weight", hf + "input_layernorm.weight"),
             (ml + "pre_mlp_layernorm.weight", hf + "post_attention_layernorm.weight")]
    if config.gdn.is_linear_layer(layer, config.num_layers):
        la, sa = hf + "linear_attn.", ml + "self_attention."
        return pairs + [(sa + n, la + m) for n, m in (("conv1d.weight", "conv1d.weight"), ("A_log", "A_log"),
                                                      ("dt_bias", "dt_bias"), ("out_proj.weight", "out_proj.weight"))]
    at, sa = hf + "self_attn.", ml + "self_attention."
    return pairs + [(sa + "q_layernorm.weight", at + "q_norm.weight"), (sa + "k_layernorm.weight", at + "k_norm.weight"),
                    (sa + "linear_proj.weight", at + "o_proj.weight")]


def qwen3_next_to_megalite(get, config: GPTConfig, padded_vocab, layers, pre_process, post_process,
                           pad_rows) -> Iterator[tuple[str, torch.Tensor]]:
    if pre_process:
        yield "embedding.word_embeddings.weight", pad_rows(get("model.embed_tokens.weight"), padded_vocab)
    for i in layers:
        hf, ml = f"model.layers.{i}.", f"layers.{i}."
        for ours, theirs in _direct_pairs(config, hf, ml, i):
            yield ours, get(theirs)
        if config.gdn.is_linear_layer(i, config.num_layers):
            la = hf + "linear_attn."
            yield ml + "self_attention.in_proj.weight", _in_proj_to_megalite(get(la + "in_proj_qkvz.weight"),
                                                                             get(la + "in_proj_ba.weight"), config)
            yield ml + "self_attention.out_norm.weight", get(la + "norm.weight") - 1
        else:
            at = hf + "self_attn."
            yield ml + "self_attention.linear_qkv.weight", _qkv_to_megalite(*(get(f"{at}{n}_proj.weight") for n in "qkv"),
                                                                            config)
        for ours, theirs in _mlp_pairs(config, hf, ml, i):
            yield ours, torch.cat([get(n) for n in theirs])
    if post_process:
        yield "final_layernorm.weight", get("model.norm.weight")
        if config.untie_embeddings_and_output_weights:
            yield "output_layer.weight", pad_rows(get("lm_head.weight"), padded_vocab)


def megalite_to_qwen3_next(get, config: GPTConfig, layers, pre_process, post_process) -> Iterator[tuple[str, torch.Tensor]]:
    vocab = config.vocab_size
    if pre_process:
        yield "model.embed_tokens.weight", get("embedding.word_embeddings.weight")[:vocab]
    for i in layers:
        hf, ml = f"model.layers.{i}.", f"layers.{i}."
        for ours, theirs in _direct_pairs(config, hf, ml, i):
            yield theirs, get(ours)
        if config.gdn.is_linear_layer(i, config.num_layers):
            qkvz, ba = _in_proj_from_megalite(get(ml + "self_attention.in_proj.weight"), config)
            yield hf + "linear_attn.in_proj_qkvz.weight", qkvz
            yield hf + "linear_attn.in_proj_ba.weight", ba
            yield hf + "linear_attn.norm.weight", get(ml + "self_attention.out_norm.weight") + 1
        else:
            for name, value in zip("qkv", _qkv_from_megalite(get(ml + "self_attention.linear_qkv.weight"), config)):
                yield f"{hf}self_attn.{name}_proj.weight", value
        for ours, theirs in _mlp_pairs(config, hf, ml, i):
            for name, value in zip(theirs, get(ours).chunk(len(theirs))):
                yield name, value.contiguous()
    if post_process:
        yield "model.norm.weight", get("final_layernorm.weight")
        if config.untie_embeddings_and_output_weights:
            yield "lm_head.weight", get("output_layer.weight")[:vocab]
