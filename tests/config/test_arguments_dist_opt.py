"""The distributed-optimizer, Megatron-FSDP and tensor-parallel overlap flags at the config
boundary: each reaches the typed config the code receives (whose behaviour the spawned tests
check: tests/parallel/data/test_optimizer_instances.py, test_megatron_fsdp.py,
tests/parallel/tensor/test_tp_comm_overlap.py, test_deferred_wgrad.py,
tests/optimizer/test_param_gather_with_step.py), Megatron's defaults, one line for each refusal
and start-up note, and the Megatron-LM functional-test configs that use them validating for 8
processes.

Megatron's behaviour: megatron/training/arguments.py validate_args (the asserts on
--overlap-param-gather-with-optimizer-step, --use-megatron-fsdp, --tp-comm-overlap) and
megatron/core/model_parallel_config.py ModelParallelConfig.__post_init__ (the
--defer-embedding-wgrad-compute checks).
"""

import pytest
import torch

from megalite.config.arguments import parse_args, validate_args
from megalite.config.run_config import CheckpointConfig, ParallelConfig, run_config, startup_notes
from megalite.parallel.tensor.comm_overlap import DEFAULTS, OverlapSetting
from tests.config.test_arguments import BASE, parsed, refused
from tests.training.launch import drop_flags

BF16_DIST = "--bf16 --use-distributed-optimizer"


def _config(extra: str, world: int):
    return run_config(parse_args(drop_flags(BASE, *extra.split()) + extra.split()), world)


def test_defaults_are_megatrons():
    args = parse_args([])
    assert (args.num_distributed_optimizer_instances, args.overlap_param_gather_with_optimizer_step,
            args.defer_embedding_wgrad_compute, args.wgrad_deferral_limit, args.use_megatron_fsdp,
            args.data_parallel_sharding_strategy, args.megatron_fsdp_main_params_dtype,
            args.megatron_fsdp_main_grads_dtype, args.megatron_fsdp_grad_comm_dtype, args.tp_comm_overlap,
            args.tp_comm_overlap_cfg) == (1, False, False, 0, False, "optim_grads_params", "fp32", "auto", "auto",
                                          False, None)


def test_instances_reach_the_layout():
    parallel = _config(BF16_DIST + " --num-distributed-optimizer-instances 2 --tensor-model-parallel-size 2", 8).parallel
    assert (parallel.layout.optimizer_instances, parallel.layout.instance_size) == (2, 2)
    assert parallel.layout.dp_cp_instance_groups() == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert parallel.layout.dp_cp_replica_groups() == [[0, 4], [2, 6], [1, 5], [3, 7]]
    assert parallel.layout.optimizer_instance_groups() == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_param_gather_with_step_deferral_and_overlap_reach_the_config(tmp_path):
    cfg = tmp_path / "ub.yaml"
    cfg.write_text("proj_fprop:\n  method: pipeline\n  num_sm: 4\n  num_splits: 2\nfc1_dgrad:\n  method: ring_exchange\n")
    config = _config("--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
                     "--overlap-param-gather-with-optimizer-step --pipeline-model-parallel-size 2 "
                     "--num-layers-per-virtual-pipeline-stage 1 --defer-embedding-wgrad-compute "
                     "--wgrad-deferral-limit 2 --tensor-model-parallel-size 2 --sequence-parallel --tp-comm-overlap "
                     f"--tp-comm-overlap-cfg {cfg} --global-batch-size 8", 8)
    assert config.optimizer.overlap_param_gather_with_optimizer_step
    assert config.parallel.overlap_param_gather_with_optimizer_step
    assert (config.parallel.defer_embedding_wgrad_compute, config.parallel.wgrad_deferral_limit) == (True, 2)
    overlap = config.parallel.tp_comm_overlap
    assert overlap["proj_fprop"] == OverlapSetting("pipeline", 2)
    assert overlap["fc1_dgrad"] == OverlapSetting("ring_exchange", 4)
    assert overlap["qkv_fprop"] == DEFAULTS["qkv_fprop"]
    assert any("proj_fprop.num_sm" in note for note in config.notes)
    assert _config("", 1).parallel.tp_comm_overlap is None


@pytest.mark.parametrize("strategy, fsdp2, reshard, dist_opt", [
    ("no_shard", False, True, False), ("optim", False, True, True),
    ("optim_grads", True, False, False), ("optim_grads_params", True, True, False)])
def test_megatron_fsdp_strategies_are_served_by_ddp_the_distributed_optimizer_and_fsdp2(strategy, fsdp2, reshard,
                                                                                        dist_opt):
    config = _config(f"--use-megatron-fsdp --data-parallel-sharding-strategy {strategy} "
                     "--use-distributed-optimizer --bf16", 2)
    parallel = config.parallel
    assert (parallel.use_torch_fsdp2, parallel.use_distributed_optimizer) == (fsdp2, dist_opt)
    assert config.optimizer.use_distributed_optimizer == dist_opt
    if fsdp2:
        assert parallel.fsdp2_reshard_after_forward == reshard
        assert config.model.params_dtype == "float32" and not config.optimizer.bf16_main_params
        assert parallel.fsdp2_reduce_dtype == torch.float32  # auto: the FSDP2 model's fp32 gradients
    else:
        assert parallel.grad_reduce_dtype == torch.bfloat16  # auto: the bf16 model's gradients
    assert any(f"--data-parallel-sharding-strategy {strategy}: served by" in note for note in config.notes)


def test_megatron_fsdp_dtypes():
    parallel = _config("--use-megatron-fsdp --bf16 --megatron-fsdp-grad-comm-dtype bf16", 2).parallel
    assert parallel.use_torch_fsdp2 and parallel.fsdp2_reduce_dtype == torch.bfloat16
    parallel = _config("--use-megatron-fsdp --data-parallel-sharding-strategy optim --bf16 "
                       "--megatron-fsdp-main-grads-dtype fp32", 2).parallel
    assert parallel.grad_reduce_dtype == torch.float32 and parallel.use_distributed_optimizer
    checkpoint = _config("--use-megatron-fsdp --ckpt-format fsdp_dtensor --save /tmp/x", 2).checkpoint
    assert checkpoint.ckpt_format == "dcp"


@pytest.mark.parametrize("extra, world, words", [
    ("--num-distributed-optimizer-instances 3 " + BF16_DIST, 4,
     ["--num-distributed-optimizer-instances 3", "does not divide the data-parallel size 4"]),
    ("--num-distributed-optimizer-instances 2", 4, ["--num-distributed-optimizer-instances 2",
                                                    "needs --use-distributed-optimizer"]),
    ("--num-distributed-optimizer-instances 2 --use-megatron-fsdp --use-distributed-optimizer", 4,
     ["--num-distributed-optimizer-instances 2 with FSDP2", "not implemented"]),
    ("--num-distributed-optimizer-instances 0", 4, ["--num-distributed-optimizer-instances", "positive"]),
    ("--num-distributed-optimizer-instances 4 --use-distributed-optimizer --num-experts 8 --disable-bias-linear "
     "--expert-model-parallel-size 2", 4, ["--num-distributed-optimizer-instances 4",
                                          "expert-data-parallel size 2"]),
    ("--overlap-param-gather-with-optimizer-step --use-distributed-optimizer", 2,
     ["--overlap-param-gather-with-optimizer-step", "--overlap-param-gather"]),
    ("--overlap-param-gather-with-optimizer-step --use-distributed-optimizer --overlap-grad-reduce "
     "--overlap-param-gather", 2, ["--overlap-param-gather-with-optimizer-step", "virtual pipeline stages"]),
    ("--defer-embedding-wgrad-compute", 1, ["--defer-embedding-wgrad-compute",
                                            "--pipeline-model-parallel-size > 1"]),
    ("--defer-embedding-wgrad-compute --pipeline-model-parallel-size 2 --use-torch-fsdp2", 2,
     ["--defer-embedding-wgrad-compute", "FSDP2"]),
    ("--defer-embedding-wgrad-compute --pipeline-model-parallel-size 2 --pipeline-schedule zb_h1 "
     "--global-batch-size 4", 2, ["--defer-embedding-wgrad-compute", "zb_h1"]),
    ("--wgrad-deferral-limit -1", 1, ["--wgrad-deferral-limit", "negative"]),
    ("--use-megatron-fsdp --use-torch-fsdp2", 2, ["--use-megatron-fsdp and --use-torch-fsdp2"]),
    ("--use-megatron-fsdp --bf16 --megatron-fsdp-main-params-dtype bf16", 2,
     ["--megatron-fsdp-main-params-dtype bf16", "fp32 main parameters"]),
    ("--use-megatron-fsdp --data-parallel-sharding-strategy optim --bf16 --megatron-fsdp-main-params-dtype auto", 2,
     ["--megatron-fsdp-main-params-dtype auto", "fp32 main parameters"]),
    ("--use-megatron-fsdp --bf16 --megatron-fsdp-main-grads-dtype bf16", 2,
     ["--megatron-fsdp-main-grads-dtype bf16", "FSDP2", "fp32 gradient shards"]),
    ("--use-megatron-fsdp --data-parallel-sharding-strategy no_shard --bf16 --megatron-fsdp-main-params-dtype fp32 "
     "--megatron-fsdp-main-grads-dtype fp32 --megatron-fsdp-grad-comm-dtype bf16", 2,
     ["--megatron-fsdp-grad-comm-dtype bf16", "in their own dtype"]),
    ("--use-megatron-fsdp --bf16 --grad-reduce-in-bf16", 2, ["--grad-reduce-in-bf16", "not FSDP2"]),
    ("--use-megatron-fsdp --optimizer-cpu-offload", 2, ["--optimizer-cpu-offload", "--use-distributed-optimizer"]),
    ("--ckpt-format fsdp_dtensor", 1, ["--ckpt-format fsdp_dtensor needs --use-megatron-fsdp"]),
    ("--tp-comm-overlap", 2, ["--tp-comm-overlap needs --sequence-parallel"]),
    ("--tp-comm-overlap --sequence-parallel", 1, ["--tp-comm-overlap", "--tensor-model-parallel-size > 1"]),
    ("--tp-comm-overlap --sequence-parallel --tensor-model-parallel-size 2 --torch-compile", 2,
     ["--tp-comm-overlap and --torch-compile"]),
    ("--tp-comm-overlap --sequence-parallel --tensor-model-parallel-size 2 --tp-comm-overlap-cfg /nonexistent.yaml",
     2, ["--tp-comm-overlap-cfg /nonexistent.yaml: cannot read it"]),
])
def test_refusals_name_the_flag(extra, world, words):
    message = refused(extra, world)
    assert all(word in message for word in words), message


def test_bad_overlap_cfg_names_the_file_and_section(tmp_path):
    cfg = tmp_path / "ub.yaml"
    cfg.write_text("qkv_fprop:\n  method: bulk\n")
    message = refused(f"--tp-comm-overlap --sequence-parallel --tensor-model-parallel-size 2 --tp-comm-overlap-cfg {cfg}", 2)
    assert message.startswith(f"{cfg}: qkv_fprop.method 'bulk'"), message
    cfg.write_text("qkv_fprop: [unclosed\n")
    message = refused(f"--tp-comm-overlap --sequence-parallel --tensor-model-parallel-size 2 --tp-comm-overlap-cfg {cfg}", 2)
    assert message.startswith(f"{cfg}:") and "YAML" in message, message


@pytest.mark.parametrize("extra, words", [
    ("--wgrad-deferral-limit 2", "--wgrad-deferral-limit 2: no effect without --defer-embedding-wgrad-compute"),
    ("--tp-comm-overlap-cfg x.yaml", "--tp-comm-overlap-cfg: no effect without --tp-comm-overlap"),
    ("--use-megatron-fsdp --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather",
     "--overlap-param-gather: FSDP2 prefetches"),
    ("--use-megatron-fsdp --ckpt-format fsdp_dtensor --save /tmp/x", "--ckpt-format fsdp_dtensor: megalite writes"),
])
def test_start_up_notes(extra, words):
    notes = startup_notes(parsed(extra, 2))
    assert any(note.startswith(words) for note in notes), notes


# The Megatron-LM functional-test configs (tests/functional_tests/test_cases/gpt, HEAD d98e8a6) that
# use these flags, their flags as given (data paths replaced); each validates for 8 processes.
_GPT3 = ("--num-layers 12 --hidden-size 512 --num-attention-heads 8 --micro-batch-size 4 --global-batch-size 32 "
         "--seq-length 1024 --max-position-embeddings 1024 --train-iters 50 --lr-decay-iters 320000 --lr 0.00015 "
         "--lr-decay-style cosine --min-lr 1.0e-5 --weight-decay 1e-2 --clip-grad 1.0 --lr-warmup-fraction .01 "
         "--split 949,50,1 --data-path /d/text --vocab-file /d/vocab.json --merge-file /d/merges.txt "
         "--transformer-impl transformer_engine --deterministic-mode --attention-softmax-in-fp32 "
         "--use-mcore-models --bf16 --save /d/ckpt --load /d/ckpt --log-params-norm --log-num-zeros-in-grad")
FUNCTIONAL = {
    "gpt3_mcore_te_tp1_pp4_vp1_dist_optimizer_overlap_grad_reduce_param_gather_overlap_optimizer":
        "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 4 --num-layers-per-virtual-pipeline-stage 1 "
        "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
        "--overlap-param-gather-with-optimizer-step --check-weight-hash-across-dp-replicas-interval 10 "
        "--ckpt-fully-parallel-load --no-gradient-accumulation-fusion --ckpt-format torch --attention-backend unfused",
    "gpt3_mcore_te_tp2_pp1_resume_torch_dist_multi_dist_optimizer_instances":
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 --use-distributed-optimizer "
        "--num-distributed-optimizer-instances 2 --overlap-grad-reduce --overlap-param-gather "
        "--no-gradient-accumulation-fusion --use-checkpoint-opt_param-scheduler --ckpt-format torch_dist "
        "--dist-ckpt-optim-fully-reshardable --dist-ckpt-strictness log_all --async-save",
    "gpt3_mcore_te_tp2_pp2_defer_embedding_wgrad_compute":
        "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --defer-embedding-wgrad-compute "
        "--wgrad-deferral-limit 2 --ckpt-format torch_dist --dist-ckpt-strictness log_all "
        "--attention-backend unfused --async-save",
    "gpt3_mcore_te_tp2_zp_z3_resume_fsdp_dtensor":
        "--tensor-model-parallel-size 2 --use-megatron-fsdp --calculate-per-token-loss "
        "--data-parallel-sharding-strategy optim_grads_params --use-distributed-optimizer "
        "--no-gradient-accumulation-fusion --megatron-fsdp-main-params-dtype fp32 --megatron-fsdp-main-grads-dtype fp32 "
        "--megatron-fsdp-grad-comm-dtype fp32 --use-checkpoint-opt_param-scheduler --ckpt-format fsdp_dtensor "
        "--async-save",
}


@pytest.mark.parametrize("name", list(FUNCTIONAL))
def test_megatron_functional_configs_validate_for_8_processes(name):
    args = validate_args(parse_args((_GPT3 + " " + FUNCTIONAL[name]).split()), 8)
    parallel = ParallelConfig.from_args(args, 8)
    if "instances" in name:
        assert parallel.layout.optimizer_instances == 2
    if "fsdp_dtensor" in name:
        assert parallel.use_torch_fsdp2 and CheckpointConfig.from_args(args).ckpt_format == "dcp"
