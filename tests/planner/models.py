"""Small models the planner tests share."""

from megalite.model.config import GPTConfig
from megalite.model.moe_config import MoEConfig
from megalite.planner.workload import Workload

GPT = GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=1000, max_position_embeddings=128)
LLAMA = GPTConfig(num_layers=4, hidden_size=64, num_attention_heads=4, num_query_groups=2, vocab_size=1000,
                  ffn_hidden_size=176, position_embedding_type="rope", normalization="RMSNorm", activation="swiglu",
                  add_bias_linear=False, untie_embeddings_and_output_weights=True, qk_layernorm=True)
MOE = LLAMA.replace(qk_layernorm=False, moe=MoEConfig(num_experts=4, ffn_hidden_size=32, router_topk=2, layer_freq=2,
                                                       shared_expert_intermediate_size=48, shared_expert_gate=True))
GPT3 = GPTConfig(num_layers=96, hidden_size=12288, num_attention_heads=96, vocab_size=51200,
                 max_position_embeddings=2048, params_dtype="float16")


def workload(config=GPT, seq=128, batch=16, precision="bf16", flash=True) -> Workload:
    return Workload(config, seq, batch, precision, flash)
