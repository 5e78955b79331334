"""Map Hugging Face GPT2LMHeadModel / LlamaForCausalLM / Qwen3ForCausalLM weights to megalite's
and back (Qwen3 is Llama with a per-head RMSNorm on queries and keys: --qk-layernorm; and,
through hf.mapping_moe, MixtralForCausalLM / Qwen2MoeForCausalLM / Qwen3MoeForCausalLM; through
hf.mapping_deepseek, DeepseekV3ForCausalLM).

Tensors are full (unsharded) on both sides; sharding to a TP rank is `param_shard_of_full`.
The mappings are generators over names fetched one at a time through a `get(name)` callable,
so a converter can stream a checkpoint tensor by tensor.
"""

from collections.abc import Callable, Iterator

import torch

from megalite.checkpoint.hf.config_fields import cfg as _cfg
from megalite.checkpoint.hf.config_fields import llama_style_fields
from megalite.checkpoint.hf.config_fields import refuse as _refuse
from megalite.model.config import GPTConfig
from megalite.checkpoint.hf import mapping_deepseek as deepseek
from megalite.checkpoint.hf import mapping_qwen3_next as qwen3_next
from megalite.checkpoint.hf.mapping_moe import (MOE_MODEL_TYPES, config_from_hf_moe, hf_config_dict_moe, moe_family_of,
                                           moe_mlp_to_hf, moe_mlp_to_megalite)
from megalite.model.rope import LLAMA3_HIGH_FREQ_FACTOR, LLAMA3_LOW_FREQ_FACTOR, LLAMA3_ORIGINAL_CONTEXT

Get = Callable[[str], torch.Tensor]

DENSE_ROPE_FAMILIES = ("llama", "qwen3")  # rotary, dense MLP; the MoE families map their MLP in hf.mapping_moe
_GPT2_ACTIVATIONS = {"gelu_new": "openai_gelu", "gelu_pytorch_tanh": "openai_gelu", "gelu": "gelu"}


def family_of(config: GPTConfig) -> str:
    """'gpt2', 'llama', 'qwen3', 'mixtral', 'qwen2_moe' or 'qwen3_moe': the Hugging Face
    architecture that can hold this model."""
    if config.use_mup:
        _refuse("use_mup", True, "models without muP: Hugging Face's GPT-2, Llama and Qwen3 scale attention by "
                "1/sqrt(head dim) and scale no logits or embeddings")
    if config.gdn is not None or config.attention_output_gate:
        qwen3_next.check_qwen3_next(config)
        return qwen3_next.MODEL_TYPE
    if config.mla is not None:
        deepseek.check_deepseek(config)
        return deepseek.MODEL_TYPE
    if config.mtp_num_layers:
        _refuse("mtp_num_layers", config.mtp_num_layers, "multi-token prediction with multi-latent attention "
                "(DeepSeek-V3) only")
    if config.moe is not None:
        return moe_family_of(config)
    if config.apply_layernorm_1p or config.rotary_interleaved or config.position_embedding_type == "none":
        _refuse("apply_layernorm_1p/rotary_interleaved/position_embedding_type",
                (config.apply_layernorm_1p, config.rotary_interleaved, config.position_embedding_type),
                "none of them: GPT-2, Llama and Qwen3 have no such variant")
    if config.qk_layernorm and (config.position_embedding_type != "rope" or config.add_bias_linear
                                or config.add_qkv_bias):
        _refuse("qk_layernorm", True, "qk-norm only as Qwen3 has it (rope, no biases)")
    if config.position_embedding_type == "learned_absolute":
        if config.normalization != "LayerNorm" or config.activation == "swiglu":
            _refuse("normalization/activation", (config.normalization, config.activation), "LayerNorm + GeLU for GPT-2")
        if not config.add_bias_linear or config.untie_embeddings_and_output_weights:
            _refuse("add_bias_linear/untie_embeddings", (config.add_bias_linear, config.untie_embeddings_and_output_weights),
                    "biases and tied embeddings for GPT-2")
        if config.num_query_groups != config.num_attention_heads:
            _refuse("num_query_groups", config.num_query_groups, "multi-head attention for GPT-2")
        if config.kv_channels * config.num_attention_heads != config.hidden_size:
            _refuse("kv_channels", config.kv_channels, "hidden_size / num_attention_heads for GPT-2")
        return "gpt2"
    if config.normalization != "RMSNorm" or config.activation != "swiglu" or config.rotary_percent != 1.0:
        _refuse("normalization/activation/rotary_percent", (config.normalization, config.activation, config.rotary_percent),
                "RMSNorm + SwiGLU + full rotary for Llama")
    if config.add_qkv_bias and not config.add_bias_linear:
        # LlamaConfig's attention_bias puts a bias on o_proj too: q/k/v-only biases have no Llama form.
        _refuse("add_qkv_bias", True, "QKV biases for Llama only together with add_bias_linear (attention_bias)")
    return "qwen3" if config.qk_layernorm else "llama"


def _rope_scaling_from_hf(field: str, rope: dict) -> dict:
    """GPTConfig fields for a Hugging Face rope_scaling / rope_parameters entry."""
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return {}
    if kind == "linear":
        return {"rotary_seq_len_interpolation_factor": float(rope["factor"])}
    if kind == "llama3":
        fixed = {"low_freq_factor": LLAMA3_LOW_FREQ_FACTOR, "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                 "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}
        for key, value in fixed.items():
            if float(rope.get(key, value)) != value:
                _refuse(f"{field}.{key}", rope.get(key), f"{value:g} (Megatron's and Llama 3.1's fixed value)")
        return {"use_rope_scaling": True, "rope_scaling_factor": float(rope["factor"])}
    _refuse(field, rope, "rope_type 'default', 'linear' or 'llama3'")


def _rope_scaling_to_hf(config: GPTConfig) -> dict | None:
    if config.use_rope_scaling and config.rotary_seq_len_interpolation_factor is not None:
        _refuse("use_rope_scaling/rotary_seq_len_interpolation_factor", True, "one of them (Hugging Face has one rope_type)")
    if config.use_rope_scaling:
        return {"rope_type": "llama3", "factor": config.rope_scaling_factor, "low_freq_factor": LLAMA3_LOW_FREQ_FACTOR,
                "high_freq_factor": LLAMA3_HIGH_FREQ_FACTOR,
                "original_max_position_embeddings": LLAMA3_ORIGINAL_CONTEXT}
    if config.rotary_seq_len_interpolation_factor is not None:
        return {"rope_type": "linear", "factor": config.rotary_seq_len_interpolation_factor}
    return None


def config_from_hf(hf_config) -> GPTConfig:
    """A GPTConfig from a transformers config object or its config.json dict."""
    model_type = _cfg(hf_config, "model_type")
    if model_type == deepseek.MODEL_TYPE:
        return deepseek.config_from_hf_deepseek(hf_config)
    if model_type == qwen3_next.MODEL_TYPE:
        return qwen3_next.config_from_hf_qwen3_next(hf_config)
    if model_type in MOE_MODEL_TYPES:
        return config_from_hf_moe(hf_config)
    if model_type == "gpt2":
        act = _cfg(hf_config, "activation_function", "gelu_new")
        if act not in _GPT2_ACTIVATIONS:
            _refuse("activation_function", act, "/".join(_GPT2_ACTIVATIONS))
        if _cfg(hf_config, "scale_attn_by_inverse_layer_idx", False):
            _refuse("scale_attn_by_inverse_layer_idx", True, "False")
        if not _cfg(hf_config, "scale_attn_weights", True):
            _refuse("scale_attn_weights", False, "True")
        if not _cfg(hf_config, "tie_word_embeddings", True):
            _refuse("tie_word_embeddings", False, "True for GPT-2")
        h = _cfg(hf_config, "n_embd")
        return GPTConfig(
            num_layers=_cfg(hf_config, "n_layer"), hidden_size=h, num_attention_heads=_cfg(hf_config, "n_head"),
            vocab_size=_cfg(hf_config, "vocab_size"), max_position_embeddings=_cfg(hf_config, "n_positions"),
            ffn_hidden_size=_cfg(hf_config, "n_inner", 4 * h), activation=_GPT2_ACTIVATIONS[act],
            norm_epsilon=_cfg(hf_config, "layer_norm_epsilon", 1e-5), init_method_std=_cfg(hf_config, "initializer_range", 0.02),
            attention_dropout=_cfg(hf_config, "attn_pdrop", 0.1), hidden_dropout=_cfg(hf_config, "resid_pdrop", 0.1),
        )
    if model_type in ("llama", "qwen3"):
        if model_type == "qwen3" and _cfg(hf_config, "use_sliding_window", False):
            _refuse("use_sliding_window", True, "False")
        if _cfg(hf_config, "hidden_act", "silu") != "silu":
            _refuse("hidden_act", _cfg(hf_config, "hidden_act"), "silu")
        if _cfg(hf_config, "pretraining_tp", 1) != 1:
            _refuse("pretraining_tp", _cfg(hf_config, "pretraining_tp"), "1")
        if _cfg(hf_config, "attention_bias", False) != _cfg(hf_config, "mlp_bias", False):
            _refuse("attention_bias", _cfg(hf_config, "attention_bias"), "attention_bias == mlp_bias")
        theta = _cfg(hf_config, "rope_theta", 10000.0)
        scaling = {}
        for field in ("rope_parameters", "rope_scaling"):  # transformers 5 / 4 names
            rope = _cfg(hf_config, field) or {}
            scaling = scaling or _rope_scaling_from_hf(field, rope)
            theta = rope.get("rope_theta", theta)
        heads = _cfg(hf_config, "num_attention_heads")
        return GPTConfig(
            **llama_style_fields(hf_config, theta), num_query_groups=_cfg(hf_config, "num_key_value_heads", heads),
            kv_channels=_cfg(hf_config, "head_dim"), add_bias_linear=bool(_cfg(hf_config, "attention_bias", False)),
            qk_layernorm=model_type == "qwen3", **scaling,
        )
    _refuse("model_type", model_type, "'gpt2', 'llama', 'qwen3', " + ", ".join(map(repr, MOE_MODEL_TYPES))
            + f", {deepseek.MODEL_TYPE!r}, {qwen3_next.MODEL_TYPE!r}")


def hf_config_dict(config: GPTConfig) -> dict:
    """config.json contents for the Hugging Face model holding `config`."""
    if family_of(config) == deepseek.MODEL_TYPE:
        return deepseek.hf_config_dict_deepseek(config)
    if family_of(config) == qwen3_next.MODEL_TYPE:
        return qwen3_next.hf_config_dict_qwen3_next(config)
    if config.moe is not None:
        return hf_config_dict_moe(config)
    if family_of(config) == "gpt2":
        return {
            "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": config.vocab_size,
            "n_positions": config.max_position_embeddings, "n_embd": config.hidden_size, "n_layer": config.num_layers,
            "n_head": config.num_attention_heads, "n_inner": config.ffn_hidden_size,
            "activation_function": "gelu_new" if config.activation == "openai_gelu" else "gelu",
            "layer_norm_epsilon": config.norm_epsilon, "initializer_range": config.init_method_std,
            "attn_pdrop": config.attention_dropout, "resid_pdrop": config.hidden_dropout,
            "embd_pdrop": config.hidden_dropout, "tie_word_embeddings": True, "torch_dtype": config.params_dtype,
        }
    family = family_of(config)
    extra = {"rope_scaling": _rope_scaling_to_hf(config)} if _rope_scaling_to_hf(config) else {}
    if family == "qwen3":
        extra.update(use_sliding_window=False)
    return {
        "architectures": ["Qwen3ForCausalLM" if family == "qwen3" else "LlamaForCausalLM"], "model_type": family,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size, "intermediate_size": config.ffn_hidden_size,
        "num_hidden_layers": config.num_layers, "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_query_groups, "head_dim": config.kv_channels,
        "max_position_embeddings": config.max_position_embeddings, "rms_norm_eps": config.norm_epsilon,
        "rope_theta": config.rotary_base, "hidden_act": "silu", "attention_bias": config.add_bias_linear,
        "mlp_bias": config.add_bias_linear, "tie_word_embeddings": not config.untie_embeddings_and_output_weights,
        "initializer_range": config.init_method_std, "attention_dropout": config.attention_dropout,
        "torch_dtype": config.params_dtype, **extra,
    }


def _qkv_to_megalite(q, k, v, config: GPTConfig) -> torch.Tensor:
    """[q; k; v] in head order -> per-group [q_g..., k_g, v_g] (dim 0)."""
    g, d = config.num_query_groups, config.kv_channels
    rest = q.shape[1:]
    return torch.cat([q.reshape(g, -1, d, *rest), k.reshape(g, 1, d, *rest), v.reshape(g, 1, d, *rest)],
                     dim=1).reshape(-1, *rest)


def _qkv_from_megalite(qkv, config: GPTConfig):
    g, d = config.num_query_groups, config.kv_channels
    per_group = config.num_attention_heads // g
    rest = qkv.shape[1:]
    grouped = qkv.reshape(g, per_group + 2, d, *rest)
    return (grouped[:, :per_group].reshape(-1, *rest), grouped[:, per_group].reshape(-1, *rest),
            grouped[:, per_group + 1].reshape(-1, *rest))


def _pad_rows(t: torch.Tensor, rows: int) -> torch.Tensor:
    return t if rows is None or t.shape[0] == rows else torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def hf_to_megalite(get: Get, config: GPTConfig, padded_vocab: int | None = None, layers=None,
                   pre_process: bool = True, post_process: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (megalite name, full tensor) for `layers` (default all), plus the embedding
    (`pre_process`) and final norm and output layer (`post_process`). Vocabulary tensors are
    zero-padded to `padded_vocab` rows when given."""
    family = family_of(config)
    layers = range(config.num_layers) if layers is None else layers
    bias = config.add_bias_linear
    if family == deepseek.MODEL_TYPE:
        yield from deepseek.deepseek_to_megalite(get, config, padded_vocab, layers, pre_process, post_process, _pad_rows)
        return
    if family == qwen3_next.MODEL_TYPE:
        yield from qwen3_next.qwen3_next_to_megalite(get, config, padded_vocab, layers, pre_process, post_process,
                                                     _pad_rows)
        return
    if family == "gpt2":
        if pre_process:
            yield "embedding.word_embeddings.weight", _pad_rows(get("transformer.wte.weight"), padded_vocab)
            yield "embedding.position_embeddings.weight", get("transformer.wpe.weight")
        for i in layers:
            hf, ml = f"transformer.h.{i}.", f"layers.{i}."
            for a, b in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
                yield ml + b + ".weight", get(hf + a + ".weight")
                yield ml + b + ".bias", get(hf + a + ".bias")
            yield ml + "self_attention.linear_qkv.weight", _qkv_to_megalite(*get(hf + "attn.c_attn.weight").t().chunk(3), config)
            yield ml + "self_attention.linear_qkv.bias", _qkv_to_megalite(*get(hf + "attn.c_attn.bias").chunk(3), config)
            for a, b in (("attn.c_proj", "self_attention.linear_proj"), ("mlp.c_fc", "mlp.linear_fc1"),
                         ("mlp.c_proj", "mlp.linear_fc2")):
                yield ml + b + ".weight", get(hf + a + ".weight").t().contiguous()  # Conv1D stores (in, out)
                yield ml + b + ".bias", get(hf + a + ".bias")
        if post_process:
            yield "final_layernorm.weight", get("transformer.ln_f.weight")
            yield "final_layernorm.bias", get("transformer.ln_f.bias")
        return
    if pre_process:
        yield "embedding.word_embeddings.weight", _pad_rows(get("model.embed_tokens.weight"), padded_vocab)
    for i in layers:
        hf, ml = f"model.layers.{i}.", f"layers.{i}."
        yield ml + "input_layernorm.weight", get(hf + "input_layernorm.weight")
        yield ml + "pre_mlp_layernorm.weight", get(hf + "post_attention_layernorm.weight")
        if config.qk_layernorm:
            yield ml + "self_attention.q_layernorm.weight", get(hf + "self_attn.q_norm.weight")
            yield ml + "self_attention.k_layernorm.weight", get(hf + "self_attn.k_norm.weight")
        for kind in ("weight", "bias") if bias else ("weight",):
            q, k, v = (get(f"{hf}self_attn.{n}_proj.{kind}") for n in "qkv")
            yield ml + f"self_attention.linear_qkv.{kind}", _qkv_to_megalite(q, k, v, config)
            yield ml + f"self_attention.linear_proj.{kind}", get(f"{hf}self_attn.o_proj.{kind}")
            if family in DENSE_ROPE_FAMILIES:
                yield ml + f"mlp.linear_fc1.{kind}", torch.cat([get(f"{hf}mlp.gate_proj.{kind}"), get(f"{hf}mlp.up_proj.{kind}")])
                yield ml + f"mlp.linear_fc2.{kind}", get(f"{hf}mlp.down_proj.{kind}")
        if family not in DENSE_ROPE_FAMILIES:
            if config.add_qkv_bias:
                q, k, v = (get(f"{hf}self_attn.{n}_proj.bias") for n in "qkv")
                yield ml + "self_attention.linear_qkv.bias", _qkv_to_megalite(q, k, v, config)
            yield from moe_mlp_to_megalite(get, config, hf, ml)
    if post_process:
        yield "final_layernorm.weight", get("model.norm.weight")
        if config.untie_embeddings_and_output_weights:
            yield "output_layer.weight", _pad_rows(get("lm_head.weight"), padded_vocab)


def megalite_to_hf(get: Get, config: GPTConfig, layers=None, pre_process: bool = True,
                   post_process: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (Hugging Face name, tensor) from full megalite tensors; padding rows are dropped.
    `pre_process` / `post_process` include the embedding / final norm and output layer."""
    family = family_of(config)
    layers = range(config.num_layers) if layers is None else layers
    vocab = config.vocab_size
    if family == deepseek.MODEL_TYPE:
        yield from deepseek.megalite_to_deepseek(get, config, layers, pre_process, post_process)
        return
    if family == qwen3_next.MODEL_TYPE:
        yield from qwen3_next.megalite_to_qwen3_next(get, config, layers, pre_process, post_process)
        return
    if family == "gpt2":
        if pre_process:
            yield "transformer.wte.weight", get("embedding.word_embeddings.weight")[:vocab]
            yield "transformer.wpe.weight", get("embedding.position_embeddings.weight")
        for i in layers:
            hf, ml = f"transformer.h.{i}.", f"layers.{i}."
            for a, b in (("ln_1", "input_layernorm"), ("ln_2", "pre_mlp_layernorm")):
                yield hf + a + ".weight", get(ml + b + ".weight")
                yield hf + a + ".bias", get(ml + b + ".bias")
            yield hf + "attn.c_attn.weight", torch.cat(_qkv_from_megalite(get(ml + "self_attention.linear_qkv.weight"), config)).t().contiguous()
            yield hf + "attn.c_attn.bias", torch.cat(_qkv_from_megalite(get(ml + "self_attention.linear_qkv.bias"), config))
            for a, b in (("attn.c_proj", "self_attention.linear_proj"), ("mlp.c_fc", "mlp.linear_fc1"),
                         ("mlp.c_proj", "mlp.linear_fc2")):
                yield hf + a + ".weight", get(ml + b + ".weight").t().contiguous()
                yield hf + a + ".bias", get(ml + b + ".bias")
        if post_process:
            yield "transformer.ln_f.weight", get("final_layernorm.weight")
            yield "transformer.ln_f.bias", get("final_layernorm.bias")
        return
    if pre_process:
        yield "model.embed_tokens.weight", get("embedding.word_embeddings.weight")[:vocab]
    for i in layers:
        hf, ml = f"model.layers.{i}.", f"layers.{i}."
        yield hf + "input_layernorm.weight", get(ml + "input_layernorm.weight")
        yield hf + "post_attention_layernorm.weight", get(ml + "pre_mlp_layernorm.weight")
        if config.qk_layernorm:
            yield hf + "self_attn.q_norm.weight", get(ml + "self_attention.q_layernorm.weight")
            yield hf + "self_attn.k_norm.weight", get(ml + "self_attention.k_layernorm.weight")
        for kind in ("weight", "bias") if config.add_bias_linear else ("weight",):
            q, k, v = _qkv_from_megalite(get(ml + f"self_attention.linear_qkv.{kind}"), config)
            yield hf + f"self_attn.q_proj.{kind}", q.contiguous()
            yield hf + f"self_attn.k_proj.{kind}", k.contiguous()
            yield hf + f"self_attn.v_proj.{kind}", v.contiguous()
            yield hf + f"self_attn.o_proj.{kind}", get(ml + f"self_attention.linear_proj.{kind}")
            if family in DENSE_ROPE_FAMILIES:
                gate, up = get(ml + f"mlp.linear_fc1.{kind}").chunk(2)
                yield hf + f"mlp.gate_proj.{kind}", gate.contiguous()
                yield hf + f"mlp.up_proj.{kind}", up.contiguous()
                yield hf + f"mlp.down_proj.{kind}", get(ml + f"mlp.linear_fc2.{kind}")
        if family not in DENSE_ROPE_FAMILIES:
            if config.add_qkv_bias:
                for name, value in zip("qkv", _qkv_from_megalite(get(ml + "self_attention.linear_qkv.bias"), config)):
                    yield hf + f"self_attn.{name}_proj.bias", value.contiguous()
            yield from moe_mlp_to_hf(get, config, hf, ml)
    if post_process:
        yield "model.norm.weight", get("final_layernorm.weight")
        if config.untie_embeddings_and_output_weights:
            yield "lm_head.weight", get("output_layer.weight")[:vocab]
