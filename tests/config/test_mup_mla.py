"""--use-mup with --multi-latent-attention, as Megatron-LM HEAD has it: MultiLatentAttention
passes core attention its own softmax scale, mscale(factor, mscale_all_dim)^2 / sqrt(qk_head_dim
+ qk_pos_emb_head_dim) (megatron/core/transformer/multi_latent_attention.py), while only
self-attention takes TransformerConfig.softmax_scale, where muP's 1 / d lives; muP's
initialisation, multipliers and optimizer scaling apply as to any model. megalite says so at
start-up, stores no muP attention scale for such a model, and refuses the two flags that would
only set that scale (--mup-base-head-dim, --mup-attn-scale-power) naming both flags."""

import math

import pytest

from megalite.config.arguments import model_config_from_args
from megalite.config.run_config import startup_notes
from megalite.model.gpt import GPTModel
from tests.config.test_arguments import parsed, refused

MLA = ("--multi-latent-attention --kv-lora-rank 16 --qk-head-dim 8 --qk-pos-emb-head-dim 4 --v-head-dim 8 "
       "--rotary-scaling-factor 40 --mscale-all-dim 1.0 --position-embedding-type rope")


def test_mla_keeps_its_own_scale_under_mup():
    args = parsed(f"{MLA} --use-mup --mup-base-hidden-size 16", 1)
    config = model_config_from_args(args, 100)
    assert config.use_mup and config.mup_width_mult == config.hidden_size / 16
    assert config.softmax_scale is None  # no muP attention scale is stored for a model that does not use one
    yarn = (0.1 * math.log(40) + 1) ** 2 / math.sqrt(8 + 4)
    assert config.mla.softmax_scale() == pytest.approx(yarn)
    model = GPTModel(config, init_seed=0)
    assert next(iter(model.layers.values())).self_attention.softmax_scale == pytest.approx(yarn)
    assert ("--use-mup with --multi-latent-attention: attention scores keep multi-latent attention's own scale, "
            "mscale^2 / sqrt(qk head dim), not muP's 1 / head dim (as in Megatron-Core); muP's initialisation, "
            "multipliers and learning rates apply") in startup_notes(args)
    dense = model_config_from_args(parsed("--use-mup --mup-base-hidden-size 16", 1), 100)
    assert dense.softmax_scale == 1 / dense.kv_channels  # self-attention still takes muP's scale


@pytest.mark.parametrize("flag", ["--mup-base-head-dim 16", "--mup-attn-scale-power 0.5"])
def test_mup_attention_scale_flags_are_refused_with_mla(flag):
    message = refused(f"{MLA} --use-mup {flag}")
    assert message.startswith(f"{flag.split()[0]} and --multi-latent-attention contradict each other")
    assert "MultiLatentAttention" in message
