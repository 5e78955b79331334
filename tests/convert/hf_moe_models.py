"""Tiny random transformers MoE models (nothing downloaded): Mixtral and Qwen2-MoE (with its
gated shared expert, QKV biases and a dense first layer)."""

import torch

VOCAB, POSITIONS = 96, 32
MOE_FAMILIES = ("mixtral", "qwen2_moe")


def hf_moe_model(family: str, seed: int = 0, num_layers: int = 4):
    import transformers

    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=POSITIONS, initializer_range=0.1,
                  rms_norm_eps=1e-5, rope_theta=500.0, num_experts_per_tok=2, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=40, num_local_experts=4, sliding_window=None, **common)
        model = transformers.MixtralForCausalLM(config)
    else:
        config = transformers.Qwen2MoeConfig(intermediate_size=48, moe_intermediate_size=20, num_experts=4,
                                             shared_expert_intermediate_size=36, mlp_only_layers=[0],
                                             norm_topk_prob=False, **common)
        model = transformers.Qwen2MoeForCausalLM(config)
    return model.eval()


def tokens(batch=2, seq=16, seed=3):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
