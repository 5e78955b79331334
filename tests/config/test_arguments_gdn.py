"""The Gated DeltaNet and gated-attention flags: Megatron-LM's defaults, each flag reaching the
model's GDNConfig / GPTConfig, --linear-attention-freq as Megatron parses it, the conversion
hints rebuilding the model, the deprecated alias's start-up line, and every refusal in one line
naming the flag (context parallelism accepted where the key heads divide by TP x CP);
--apply-wd-to-qk-layernorm reaching the optimizer's groups."""

import pytest
import torch

from megalite.config.arguments import model_config_from_args
from megalite.config.gdn import gdn_flags, gdn_notes, parse_linear_attention_freq
from megalite.config.run_config import OptimizerConfig
from megalite.optimizer.mixed_precision import no_weight_decay
from tests.config.test_arguments import parsed, refused

GDN = "--experimental-attention-variant gdn --linear-attention-freq 2"


def test_defaults_are_megatrons():
    gdn = model_config_from_args(parsed(GDN, 1), 100).gdn
    assert (gdn.linear_conv_kernel_dim, gdn.linear_key_head_dim, gdn.linear_value_head_dim,
            gdn.linear_num_key_heads, gdn.linear_num_value_heads) == (4, 128, 128, 16, 32)
    config = model_config_from_args(parsed("", 1), 100)
    assert config.gdn is None and not config.attention_output_gate


def test_every_flag_reaches_the_config_and_the_hints_rebuild_it():
    args = parsed("--experimental-attention-variant gated_delta_net --linear-attention-freq ([1]*1+[0]*1)*2 "
                  "--linear-conv-kernel-dim 3 --linear-key-head-dim 8 --linear-value-head-dim 6 "
                  "--linear-num-key-heads 2 --linear-num-value-heads 4 --attention-output-gate", 1)
    config = model_config_from_args(args, 100)
    assert config.attention_output_gate
    assert config.gdn.to_dict() == dict(linear_attention_freq=[1, 0, 1, 0], linear_conv_kernel_dim=3,
                                        linear_key_head_dim=8, linear_value_head_dim=6, linear_num_key_heads=2,
                                        linear_num_value_heads=4, chunk_size=64)
    again = model_config_from_args(parsed(" ".join(gdn_flags(config)), 1), 100)
    assert again.gdn == config.gdn and again.attention_output_gate
    assert gdn_notes(args) == ["--experimental-attention-variant gated_delta_net is deprecated (Megatron's name "
                               "for gdn): use gdn"]
    assert gdn_notes(parsed(GDN, 1)) == []


def test_linear_attention_freq_as_megatron_parses_it():
    assert parse_linear_attention_freq("4") == 4
    assert parse_linear_attention_freq("([0]+[1]*3)") == (0, 1, 1, 1)
    assert parse_linear_attention_freq("([1]*2+[0]*2)*2") == (1, 1, 0, 0, 1, 1, 0, 0)
    with pytest.raises(ValueError, match="only integers, lists"):
        parse_linear_attention_freq("[__import__('os')]")


@pytest.mark.parametrize("extra, message", [
    ("--experimental-attention-variant gdn2 --linear-attention-freq 2", "gdn2: Gated DeltaNet 2 (gdn2) is not implemented"),
    ("--experimental-attention-variant dsa", "dsa: DeepSeek sparse attention (dsa) is not implemented"),
    ("--experimental-attention-variant gdn", "needs --linear-attention-freq"),
    ("--linear-num-key-heads 4", "--linear-num-key-heads needs --experimental-attention-variant gdn"),
    (GDN + " --linear-num-key-heads 3 --linear-num-value-heads 4", "not a multiple of linear_num_key_heads"),
    ("--experimental-attention-variant gdn --linear-attention-freq [1,0,1]", "3 entries for 4 layers"),
    (GDN + " --linear-num-key-heads 3 --linear-num-value-heads 3 --tensor-model-parallel-size 2",
     "--linear-num-key-heads 3 must be divisible by --tensor-model-parallel-size 2"),
    (GDN + " --linear-num-key-heads 3 --linear-num-value-heads 3 --context-parallel-size 2",
     "--linear-num-key-heads 3 must be divisible by --tensor-model-parallel-size 1 x --context-parallel-size 2 = 2"),
])
def test_refusals(extra, message):
    world = 2 if "size 2" in extra else 1
    assert message in refused(extra, world)


def test_context_parallelism_accepted_when_the_key_heads_divide():
    args = parsed(GDN + " --linear-num-key-heads 2 --linear-num-value-heads 4 --context-parallel-size 2", 2)
    assert args.context_parallel_size == 2 and model_config_from_args(args, 100).gdn.linear_num_key_heads == 2


def test_apply_wd_to_qk_layernorm_decays_the_qk_norms_only():
    assert OptimizerConfig.from_args(parsed("--apply-wd-to-qk-layernorm --lr 1e-3 --train-iters 1", 1)) \
        .apply_wd_to_qk_layernorm
    norm, bias = torch.zeros(4), torch.zeros(4)
    for name in ("layers.0.self_attention.q_layernorm.weight", "layers.0.self_attention.k_layernorm.weight"):
        assert no_weight_decay(name, norm) and not no_weight_decay(name, norm, decay_qk_layernorm=True)
    assert no_weight_decay("layers.0.input_layernorm.weight", norm, decay_qk_layernorm=True)
    assert no_weight_decay("layers.0.self_attention.A_log", bias, decay_qk_layernorm=True)
