"""FLOPs of Gated DeltaNet hybrids: the linear layers' in_proj / out_proj weights in P_mm, their
convolution and chunked delta rule in place of 12 s h, the gate heads of gated attention; and
the weights counted equal the model's own matmul weights."""

from megalite.model.config import GPTConfig
from megalite.model.gpt import GPTModel
from megalite.training.flops import attention_matmul_parameters, attention_score_flops, flops_per_token

GDN = dict(linear_attention_freq=2, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=6,
           linear_num_key_heads=2, linear_num_value_heads=4, chunk_size=16)


def _config(**changes):
    values = dict(num_layers=4, hidden_size=32, num_attention_heads=4, num_query_groups=2, vocab_size=100,
                  activation="swiglu", add_bias_linear=False, position_embedding_type="rope", gdn=dict(GDN),
                  attention_output_gate=True)
    return GPTConfig(**{**values, **changes})


def test_attention_weights_counted_are_the_models():
    config = _config()
    model = GPTModel(config)
    for n in (0, 1):
        attention = model.layers[str(n)].self_attention
        weights = sum(p.numel() for name, p in attention.named_parameters() if p.ndim == 2)
        assert attention_matmul_parameters(config, n) == weights, n


def test_linear_layers_replace_the_score_term():
    config, s = _config(), 1024
    h, dk, dv, c, nk, nv, k = 32, 8, 6, 16, 2, 4, 4
    linear = 6 * k * (2 * nk * dk + nv * dv) + 6 * nv * (3 * dk * dv + c * (3 * dk + 2 * dv))
    assert attention_score_flops(config, s, 0) == linear
    assert attention_score_flops(config, s, 1) == 12 * s * h
    full = _config(gdn=None)
    extra = 6 * 2 * (attention_matmul_parameters(config, 0) - attention_matmul_parameters(full, 0)) \
        + 2 * (linear - 12 * s * h)
    assert flops_per_token(config, s, 128) == flops_per_token(full, s, 128) + extra
