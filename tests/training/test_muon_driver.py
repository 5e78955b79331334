"""--optimizer muon through the flags and the training driver (`python -m megalite.pretrain_gpt`,
four gloo rank processes): the flags reach build_muon_optimizer; a TP 2 x PP 2 run stopped by
--exit-interval and resumed from its checkpoint is bit-identical to the uninterrupted run; its
checkpoint resharded onto TP 1 x DP 4 under the distributed optimizer (dist_muon) continues it
within 1e-5; TP 2 x PP 2, and TP 2 x DP 2 under FSDP2 and under the distributed optimizer, equal
one process within 1e-5 over 6 iterations; the refused combinations stop
with one line before any process group.
"""

import shutil

import pytest

from megalite.checkpoint.dcp.checkpoint import read_tracker
from megalite.config.arguments import parse_args, validate_args
from megalite.config.run_config import OptimizerConfig
from tests.training.launch import BASE, run, train_losses

ITERS, STOP = 6, 3
MUON = ["--optimizer", "muon", "--muon-tp-mode", "duplicated", "--muon-fp32-matmul-prec", "high",
        "--muon-nesterov", "--muon-momentum", "0.95",
        "--train-iters", str(ITERS), "--eval-iters", "0", "--eval-interval", "1000",
        "--hidden-dropout", "0", "--attention-dropout", "0"]
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"]


def _validated(*extra, world=4):
    muon = MUON[2:] if "--optimizer" in extra else MUON
    return validate_args(parse_args(BASE + muon + list(extra)), world)


def test_flags_reach_the_optimizer():
    args = _validated("--muon-no-split-qkv", "--muon-scale-mode", "unit_rms_norm", "--muon-num-ns-steps", "7",
                      "--muon-coefficient-type", "polar_express", "--muon-extra-scale-factor", "0.2",
                      "--muon-scalar-optimizer", "lion", "--lion-beta1", "0.9", "--lion-beta2", "0.99")
    muon = OptimizerConfig.from_args(args).muon
    assert muon == dict(momentum=0.95, nesterov=True, scale_mode="unit_rms_norm", num_ns_steps=7,
                        coefficient_type="polar_express", tp_mode="duplicated", split_qkv=False,
                        extra_scale_factor=0.2, fp32_matmul_prec="high", scalar_optimizer="lion",
                        lion_beta1=0.9, lion_beta2=0.99)
    defaults = OptimizerConfig.from_args(validate_args(parse_args(BASE + ["--optimizer", "muon", "--train-iters", "6"]), 1)).muon
    assert defaults["split_qkv"] and defaults["momentum"] == 0.9 and not defaults["nesterov"]
    assert defaults["fp32_matmul_prec"] == "medium" and defaults["coefficient_type"] == "quintic"
    assert OptimizerConfig.from_args(validate_args(parse_args(BASE + ["--train-iters", "6"]), 1)).muon is None
    assert validate_args(parse_args(BASE + MUON + ["--use-torch-fsdp2"]), 4).use_torch_fsdp2
    dist_muon = validate_args(parse_args(BASE + MUON[2:] + ["--optimizer", "dist_muon"]), 4)
    assert dist_muon.optimizer == "muon" and OptimizerConfig.from_args(dist_muon).use_distributed_optimizer
    assert _validated("--num-experts", "4", "--expert-model-parallel-size", "2").num_experts == 4  # experts: ETP split


@pytest.mark.parametrize("extra, match", [
    (["--use-megatron-fsdp"], "--use-megatron-fsdp"),
    (["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"],
     "--num-distributed-optimizer-instances"),
    (["--fp16"], "--fp16"),
    (["--muon-fp32-matmul-prec", "low"], "--muon-fp32-matmul-prec"),
    (["--muon-coefficient-type", "cubic"], "--muon-coefficient-type 'cubic'"),
    (["--muon-num-ns-steps", "0"], "--muon-num-ns-steps"),
    (["--muon-use-syrk"], "--muon-use-syrk"),
    (["--decoupled-lr", "1e-3"], "--decoupled-lr"),
    (["--use-mup"], "--use-mup"),
    (["--optimizer", "lion"], "--optimizer"),
])
def test_refused_combinations_name_their_flag(extra, match):
    with pytest.raises(ValueError, match=match):
        _validated(*extra)


def _run(tmp, *extra):
    run(BASE + MUON + list(extra) + ["--metrics-file", str(tmp / "metrics.jsonl")], 4, tmp / "logs")
    return train_losses(tmp / "metrics.jsonl")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon_uninterrupted")
    losses = _run(tmp, *TP2_PP2, "--save", str(tmp / "ckpt"), "--save-interval", str(STOP))
    assert sorted(losses) == list(range(1, ITERS + 1))
    return tmp, losses


def test_resumed_tp2_pp2_run_is_bit_identical(tmp_path, uninterrupted):
    _, losses = uninterrupted
    _run(tmp_path, *TP2_PP2, "--exit-interval", str(STOP), "--save", str(tmp_path / "ckpt"))
    assert read_tracker(tmp_path / "ckpt") == STOP
    resumed = _run(tmp_path, *TP2_PP2, "--load", str(tmp_path / "ckpt"), "--save", str(tmp_path / "ckpt"))
    assert resumed == losses  # bit-identical floats, every iteration


def test_checkpoint_reshards_from_tp2_pp2_to_tp1_dp4_with_dist_muon(tmp_path, uninterrupted):
    """Loaded by the distributed optimizer (--optimizer dist_muon), which shards the momentum."""
    original, losses = uninterrupted
    name = f"iter_{STOP:07d}"
    shutil.copytree(original / "ckpt" / name, tmp_path / "ckpt" / name)
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text(str(STOP))
    args = BASE + MUON[2:] + ["--optimizer", "dist_muon", "--load", str(tmp_path / "ckpt")]
    run(args + ["--metrics-file", str(tmp_path / "metrics.jsonl")], 4, tmp_path / "logs")
    resumed = train_losses(tmp_path / "metrics.jsonl")
    assert sorted(resumed) == list(range(STOP + 1, ITERS + 1))
    for it, loss in resumed.items():
        assert abs(loss - losses[it]) <= 1e-5 * abs(losses[it]), (it, loss, losses[it])


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("muon_one_process")
    run(BASE + MUON + ["--metrics-file", str(tmp / "metrics.jsonl")], 1, tmp / "logs")
    losses = train_losses(tmp / "metrics.jsonl")
    assert sorted(losses) == list(range(1, ITERS + 1))
    return losses


def _close(losses, reference):
    assert sorted(losses) == sorted(reference)
    for it, loss in losses.items():
        assert abs(loss - reference[it]) <= 1e-5 * abs(reference[it]), (it, loss, reference[it])


def test_tp2_pp2_equals_one_process_over_6_iterations(uninterrupted, one_process):
    _close(uninterrupted[1], one_process)


@pytest.mark.parametrize("layout", [["--use-torch-fsdp2"], ["--use-distributed-optimizer"]], ids=["fsdp2", "distopt"])
def test_tp2_dp2_equals_one_process_over_6_iterations(tmp_path, one_process, layout):
    _close(_run(tmp_path, "--tensor-model-parallel-size", "2", *layout), one_process)
