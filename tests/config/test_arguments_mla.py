"""The multi-latent attention, YaRN and multi-token prediction flags: Megatron-LM's defaults, each
flag reaching the model's MLAConfig / GPTConfig, the flags megalite prints for a model
(conversion hints) rebuilding it, the start-up lines, and every impossible combination stopped
with one line naming the flag."""

import pytest

from megalite.config.arguments import model_config_from_args
from megalite.config.mla import mla_flags, mla_notes
from megalite.config.validate import validate_args
from tests.config.test_arguments import parsed, refused

MLA = "--multi-latent-attention"


def test_defaults_are_megatrons():
    args = parsed(MLA, 1)
    config = model_config_from_args(args, 100)
    mla = config.mla
    assert (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_head_dim, mla.qk_pos_emb_head_dim, mla.v_head_dim) == \
        (None, 32, 128, 64, 128)
    assert (mla.rope_type, mla.rotary_scaling_factor, mla.mscale, mla.mscale_all_dim) == ("yarn", 1.0, 1.0, 0.0)
    assert (mla.original_max_position_embeddings, mla.beta_fast, mla.beta_slow) == (4096, 32.0, 1.0)
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor) == (None, 0.1)
    assert model_config_from_args(parsed("", 1), 100).mla is None


def test_every_flag_reaches_the_config():
    args = parsed(MLA + " --q-lora-rank 24 --kv-lora-rank 16 --qk-head-dim 8 --qk-pos-emb-head-dim 4 --v-head-dim 6 "
                  "--rope-type yarn --rotary-scaling-factor 40 --mscale 0.7 --mscale-all-dim 0.5 "
                  "--yarn-original-max-position-embeddings 2048 --yarn-beta-fast 16 --yarn-beta-slow 2 "
                  "--no-yarn-correction-range-round-to-int --mtp-num-layers 2 --mtp-loss-scaling-factor 0.3 "
                  "--qk-layernorm", 1)
    config = model_config_from_args(args, 100)
    assert config.mla.to_dict() == dict(
        kv_lora_rank=16, q_lora_rank=24, qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=6, rope_type="yarn",
        rotary_scaling_factor=40.0, original_max_position_embeddings=2048, beta_fast=16.0, beta_slow=2.0, mscale=0.7,
        mscale_all_dim=0.5, correction_range_round_to_int=False)
    assert (config.mtp_num_layers, config.mtp_loss_scaling_factor, config.qk_layernorm) == (2, 0.3, True)
    again = parsed(" ".join(mla_flags(config)) + " --qk-layernorm", 1)
    assert model_config_from_args(again, 100) == config


def test_start_up_lines():
    args = parsed(MLA + " --kv-channels 64 --mla-down-proj-fusion", 1)
    notes = mla_notes(args)
    assert any(n.startswith("--kv-channels 64: not used by --multi-latent-attention") for n in notes)
    assert any(n.startswith("--mla-down-proj-fusion") for n in notes)
    assert mla_notes(parsed("--rope-type rope", 1)) == [
        "--rope-type rope: standard attention's RoPE is --position-embedding-type rope; nothing changes"]


@pytest.mark.parametrize("extra, message", [
    ("--q-lora-rank 24", "--q-lora-rank needs --multi-latent-attention"),
    ("--mscale 0.5", "--mscale needs --multi-latent-attention"),
    ("--rope-type yarn", "--rope-type yarn needs --multi-latent-attention"),
    (MLA + " --group-query-attention --num-query-groups 2", "contradict each other"),
    (MLA + " --cache-mla-latents", "--cache-mla-latents"),
    (MLA + " --position-embedding-type rope --rotary-interleaved", "--rotary-interleaved does not apply"),
    (MLA + " --position-embedding-type rope --use-rope-scaling", "--use-rope-scaling does not apply"),
    (MLA + " --rotary-percent 0.5", "--rotary-percent 0.5 does not apply to --rope-type yarn"),
    (MLA + " --qk-pos-emb-head-dim 5", "--qk-pos-emb-head-dim 5 must be even"),
    (MLA + " --kv-lora-rank 0", "--kv-lora-rank must be positive"),
    (MLA + " --rotary-scaling-factor 0", "--rotary-scaling-factor must be positive"),
    ("--mtp-num-layers 0", "--mtp-num-layers must be positive"),
    ("--mtp-loss-scaling-factor -1", "--mtp-loss-scaling-factor must not be negative"),
])
def test_refusals_name_the_flag(extra, message):
    assert message in refused(extra)


def test_rope_type_rope_keeps_rotary_percent():
    args = parsed(MLA + " --rope-type rope --rotary-percent 0.5", 1)
    assert validate_args(args, 1) is args and model_config_from_args(args, 100).mla.rope_type == "rope"
