"""The --moe-* flags and expert parallelism: each flag reaches the model's MoEConfig (whose
behaviour tests/model/test_moe.py and tests/parallel/expert test), Megatron's defaults, and
every impossible combination stopped with one line naming the flag."""

import pytest

from megalite.config.arguments import model_config_from_args
from tests.config.test_arguments import parsed, refused

MOE = "--num-experts 8 --disable-bias-linear"


def test_defaults_are_megatrons():
    config = model_config_from_args(parsed(MOE, 8), 100).moe
    assert (config.router_topk, config.score_function, config.load_balancing_type, config.aux_loss_coeff,
            config.z_loss_coeff, config.capacity_factor, config.token_drop_policy, config.token_dispatcher_type,
            config.bias_update_rate, config.layer_freq, config.ffn_hidden_size) == \
        (2, "softmax", "aux_loss", 0.0, None, None, "probs", "allgather", 1e-3, 1, 256)
    assert model_config_from_args(parsed("", 1), 100).moe is None


def test_every_flag_reaches_the_config():
    args = parsed(MOE + " --moe-ffn-hidden-size 40 --moe-layer-freq ([0]+[1]*3) --moe-router-topk 4 "
                  "--moe-router-score-function sigmoid --moe-router-pre-softmax --moe-router-topk-scaling-factor 2.5 "
                  "--moe-router-dtype fp64 --moe-router-num-groups 4 --moe-router-group-topk 2 "
                  "--moe-router-load-balancing-type seq_aux_loss --moe-aux-loss-coeff 0.01 --moe-z-loss-coeff 0.001 "
                  "--moe-router-enable-expert-bias --moe-router-bias-update-rate 0.02 "
                  "--moe-expert-capacity-factor 1.5 --moe-pad-expert-input-to-capacity --moe-token-drop-policy position "
                  "--moe-shared-expert-intermediate-size 48 --moe-shared-expert-gate --moe-grouped-gemm "
                  "--moe-token-dispatcher-type alltoall --expert-model-parallel-size 4 "
                  "--expert-tensor-parallel-size 2 --tensor-model-parallel-size 2", 16)
    moe = model_config_from_args(args, 100).moe
    assert moe.to_dict() == dict(
        num_experts=8, ffn_hidden_size=40, layer_freq=[0, 1, 1, 1], router_topk=4, score_function="sigmoid",
        pre_softmax=True, topk_scaling_factor=2.5, router_dtype="fp64", num_groups=4, group_topk=2,
        load_balancing_type="seq_aux_loss", aux_loss_coeff=0.01, z_loss_coeff=0.001, enable_expert_bias=True,
        bias_update_rate=0.02, capacity_factor=1.5, pad_to_capacity=True, token_drop_policy="position",
        shared_expert_intermediate_size=48, shared_expert_gate=True, grouped_gemm=True,
        token_dispatcher_type="alltoall")
    assert args.expert_model_parallel_size == 4


def test_expert_grid_over_tensor_and_context_ranks():
    """ETP independent of TP, and EP carved from DP x CP (and TP when ETP < TP)."""
    args = parsed(MOE + " --tensor-model-parallel-size 2 --expert-tensor-parallel-size 1 --expert-model-parallel-size 4 "
                  "--context-parallel-size 2 --attention-dropout 0", 8)
    assert (args.expert_tensor_parallel_size, args.expert_model_parallel_size, args.data_parallel_size) == (1, 4, 2)
    for extra in ("--use-torch-fsdp2", "--calculate-per-token-loss"):  # both run with experts
        assert parsed(MOE + " --expert-model-parallel-size 2 " + extra, 4).expert_model_parallel_size == 2


@pytest.mark.parametrize("extra, world, words", [
    ("--moe-router-topk 4", 1, ["--moe-router-topk", "needs --num-experts"]),
    ("--expert-model-parallel-size 2", 2, ["--expert-model-parallel-size", "needs --num-experts"]),
    ("--num-experts 8", 1, ["--disable-bias-linear"]),
    (MOE + " --expert-model-parallel-size 3", 3, ["--num-experts 8", "--expert-model-parallel-size 3"]),
    (MOE + " --expert-model-parallel-size 4", 2, ["--expert-model-parallel-size 4", "does not divide the 2 ranks"]),
    (MOE + " --expert-tensor-parallel-size 2 --expert-model-parallel-size 2 --tensor-model-parallel-size 2", 2,
     ["--expert-tensor-parallel-size 2 x --expert-model-parallel-size 2", "2 ranks of a pipeline stage"]),
    (MOE + " --expert-tensor-parallel-size 3", 3, ["--moe-ffn-hidden-size", "--expert-tensor-parallel-size 3"]),
    (MOE + " --expert-tensor-parallel-size 0", 1, ["--expert-tensor-parallel-size must be positive"]),
    (MOE + " --moe-router-topk 9", 1, ["--moe-router-topk 9"]),
    (MOE + " --moe-router-group-topk 2", 1, ["--moe-router-num-groups"]),
    (MOE + " --moe-router-num-groups 3 --moe-router-group-topk 2", 1, ["--moe-router-num-groups 3"]),
    (MOE + " --moe-router-enable-expert-bias", 1, ["--moe-router-score-function sigmoid"]),
    (MOE + " --moe-pad-expert-input-to-capacity", 1, ["--moe-expert-capacity-factor"]),
    (MOE + " --moe-shared-expert-gate", 1, ["--moe-shared-expert-intermediate-size"]),
    (MOE + " --moe-layer-freq [1,0]", 1, ["--moe-layer-freq", "4 layers"]),
    (MOE + " --moe-layer-freq os.system", 1, ["--moe-layer-freq"]),
    (MOE + " --moe-token-dispatcher-type flex --moe-pad-expert-input-to-capacity --moe-expert-capacity-factor 1", 1,
     ["--moe-token-dispatcher-type flex", "deepep", "--moe-pad-expert-input-to-capacity"]),
    (MOE + " --moe-router-score-function sqrtsoftplus", 1, ["--moe-router-score-function"]),
    (MOE + " --moe-router-load-balancing-type quantile_balancing", 1, ["--moe-router-load-balancing-type"]),
    (MOE + " --moe-router-load-balancing-type sinkhorn --moe-aux-loss-coeff 0.1", 1, ["sinkhorn",
                                                                                      "--moe-aux-loss-coeff"]),
    (MOE + " --moe-aux-loss-coeff -1", 1, ["--moe-aux-loss-coeff"]),
])
def test_refused_naming_the_flag(extra, world, words):
    message = refused(extra, world)
    assert all(w in message for w in words), message
