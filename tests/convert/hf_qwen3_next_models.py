"""A tiny random transformers Qwen3NextForCausalLM (nothing downloaded): linear attention on layers
0 and 2, gated full attention on 1 and 3 (head_dim 16, a quarter of it rotary), a dense first MLP,
MoE with a gated shared expert elsewhere; every norm weight moved away from its initial value."""

import torch

VOCAB = 96


def hf_qwen3_next_model(seed: int = 0, **changes):
    import transformers

    torch.manual_seed(seed)
    fields = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, intermediate_size=48, max_position_embeddings=64, initializer_range=0.1,
                  rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                      "partial_rotary_factor": 0.25},
                  layer_types=["linear_attention", "full_attention"] * 2, linear_conv_kernel_dim=4,
                  linear_key_head_dim=8, linear_value_head_dim=4, linear_num_key_heads=2, linear_num_value_heads=4,
                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=20, shared_expert_intermediate_size=36,
                  mlp_only_layers=[0], norm_topk_prob=True, tie_word_embeddings=False,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**{**fields, **changes}))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("linear_attn.norm.weight"):  # stores w (starts at 1)
                p.uniform_(0.5, 1.5)
            elif "norm" in name:  # zero-centred: stores w - 1 (starts at 0)
                p.uniform_(-0.4, 0.4)
    return model.eval()


def tokens(batch=2, seq=16, seed=3):
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
