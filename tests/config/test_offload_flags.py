"""--fine-grained-activation-offloading, --offload-modules, --min-offloaded-tensor-size and the
tuning flags (--activation-offload-fraction, --delta-offload-bytes-across-pp-ranks,
--fine-grained-offloading-max-inflight-offloads; --delay-offload-until-cuda-graph refused):
Megatron's refusals, megalite's, the start-up lines and the GPTConfig fields they set."""

import pytest

from megalite.config.arguments import model_config_from_args
from megalite.model.offload import OFFLOAD_MODULES
from tests.config.test_arguments import parsed, refused
from tests.config.test_megatron_engine_flags import lines

ON = "--fine-grained-activation-offloading --offload-modules "
VALID = "(valid: attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act)"
MOE = " --num-experts 4 --disable-bias-linear --moe-grouped-gemm"


def test_the_functional_configs_modules_reach_the_model():
    args = parsed(ON + "expert_fc1 moe_act attn_norm mlp_norm qkv_linear core_attn attn_proj --min-offloaded-tensor-size 8"
                  + MOE + " --recompute-granularity selective --recompute-modules layernorm mlp moe_act", 1)
    config = model_config_from_args(args, 100)
    assert set(config.offload_modules) == set(OFFLOAD_MODULES)
    assert config.min_offloaded_tensor_size == 8
    assert model_config_from_args(parsed("", 1), 100).offload_modules == ()
    assert model_config_from_args(parsed(ON + "core_attn", 1), 100).min_offloaded_tensor_size == 1024 * 1024


def test_the_tuning_flags_reach_the_model():
    tuned = ON + ("core_attn --activation-offload-fraction 0.5 --delta-offload-bytes-across-pp-ranks 1024 "
                  "--fine-grained-offloading-max-inflight-offloads 0")
    config = model_config_from_args(parsed(tuned, 1), 100)
    assert (config.activation_offload_fraction, config.delta_offload_bytes_across_pp_ranks,
            config.offload_max_inflight) == (0.5, 1024, 0)
    config = model_config_from_args(parsed(ON + "core_attn", 1), 100)
    assert (config.activation_offload_fraction, config.delta_offload_bytes_across_pp_ranks,
            config.offload_max_inflight) == (1.0, 0, None)


@pytest.mark.parametrize("extra, message", [
    (ON + "core_atn", f"--offload-modules core_atn: unknown module {VALID}"),
    (ON + "fused_group_mlp", "--offload-modules fused_group_mlp: offloads Transformer Engine's fused grouped MLP "
                             f"(--use-transformer-engine-op-fuser), which megalite does not have {VALID}"),
    (ON + "gdp_qkv", f"--offload-modules gdp_qkv: offloads the GatedDeltaProduct mixer, which megalite does not have "
                     f"{VALID}"),
    ("--fine-grained-activation-offloading", f"--fine-grained-activation-offloading needs --offload-modules (as in "
                                             f"Megatron; valid: {VALID[8:]}"),
    (ON + "attn_proj", "--offload-modules attn_proj needs core_attn too: the input of attn_proj is the output of "
                       "core_attn, which core_attn's backward needs (as in Megatron)"),
    (ON + "moe_act" + MOE + " --recompute-granularity selective --recompute-modules moe",
     "--offload-modules expert_fc1 / moe_act with --recompute-modules moe: the whole MoE layer is recomputed, nothing "
     "inside it is kept to offload (as in Megatron)"),
    (ON + "core_attn --min-offloaded-tensor-size -1", "--min-offloaded-tensor-size must not be negative, got -1"),
    (ON + "core_attn --recompute-granularity full --recompute-method uniform --recompute-num-layers 1",
     "--fine-grained-activation-offloading with --recompute-granularity full: whole layers are recomputed, nothing "
     "inside them is kept to offload"),
    (ON + "core_attn --activation-offload-fraction 1.5", "--activation-offload-fraction must lie in [0, 1], got 1.5"),
    (ON + "core_attn --delta-offload-bytes-across-pp-ranks -1",
     "--delta-offload-bytes-across-pp-ranks must not be negative, got -1"),
    (ON + "core_attn --fine-grained-offloading-max-inflight-offloads -1",
     "--fine-grained-offloading-max-inflight-offloads must not be negative, got -1"),
    (ON + "expert_fc1 --delay-offload-until-cuda-graph" + MOE,
     "--delay-offload-until-cuda-graph: defers the expert offloads to after a Transformer Engine CUDA graph's replay, "
     "which needs Transformer Engine CUDA graphs (--cuda-graph-impl transformer_engine); megalite has none"),
    (ON + "core_attn --torch-compile", "--fine-grained-activation-offloading with --torch-compile: the offload hooks "
                                       "on saved tensors run in eager mode only"),
])
def test_refused(extra, message):
    assert refused(extra) == message


def test_start_up_lines():
    assert lines("--offload-modules core_attn") == [
        "--offload-modules core_attn: no effect without --fine-grained-activation-offloading (as in Megatron)"]
    said = lines(ON + "core_attn attn_proj --recompute-granularity selective")
    assert said[0].startswith("--fine-grained-activation-offloading: what core_attn, attn_proj save for backward "
                              "(tensors of 1048576 elements or more) is moved to CPU memory")
    assert said[1].startswith("--offload-modules core_attn: core attention is recomputed")
    assert len(lines(ON + "core_attn")) == 1
    tuned = lines(ON + "core_attn --activation-offload-fraction 0.5 --delta-offload-bytes-across-pp-ranks 8")
    assert tuned[0].endswith(
        "stays on the device where its backward comes next, as in Megatron, --activation-offload-fraction 0.5, "
        "--delta-offload-bytes-across-pp-ranks 8")
    assert lines("--activation-offload-fraction 0.5 --fine-grained-offloading-max-inflight-offloads 1") == [
        "--activation-offload-fraction 0.5: no effect without --fine-grained-activation-offloading (as in Megatron)",
        "--fine-grained-offloading-max-inflight-offloads 1: no effect without --fine-grained-activation-offloading "
        "(as in Megatron)"]
