"""Reading a Hugging Face config (a transformers config object or its config.json dict), shared
by the dense, MoE and DeepSeek-V3 mappings: a field with its default, a one-line refusal, and the
GPTConfig fields every Llama-style family (Llama, Qwen3, Mixtral, Qwen-MoE, DeepSeek-V3) spells
the same way."""


def cfg(hf_config, name, default=None):
    value = hf_config.get(name, default) if isinstance(hf_config, dict) else getattr(hf_config, name, default)
    return default if value is None else value


def refuse(field: str, value, expected: str):
    raise ValueError(f"unsupported Hugging Face config: {field}={value!r} (megalite supports {expected})")


def llama_style_fields(hf_config, rope_theta: float) -> dict:
    """GPTConfig keyword arguments of a Llama-style decoder: RMSNorm, SwiGLU, rotary positions
    at `rope_theta`, no hidden dropout; each family adds its attention, biases and MLP."""
    return dict(
        num_layers=cfg(hf_config, "num_hidden_layers"), hidden_size=cfg(hf_config, "hidden_size"),
        num_attention_heads=cfg(hf_config, "num_attention_heads"), ffn_hidden_size=cfg(hf_config, "intermediate_size"),
        vocab_size=cfg(hf_config, "vocab_size"), max_position_embeddings=cfg(hf_config, "max_position_embeddings"),
        position_embedding_type="rope", rotary_base=float(rope_theta), normalization="RMSNorm",
        norm_epsilon=cfg(hf_config, "rms_norm_eps", 1e-6), activation="swiglu",
        untie_embeddings_and_output_weights=not cfg(hf_config, "tie_word_embeddings", False),
        init_method_std=cfg(hf_config, "initializer_range", 0.02),
        attention_dropout=cfg(hf_config, "attention_dropout", 0.0), hidden_dropout=0.0)
