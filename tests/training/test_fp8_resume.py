"""FP8 training through the driver (`python -m megalite.pretrain_gpt`, 2 gloo rank processes,
TP=2 with sequence parallelism): the delayed-scaling state (every FP8 linear's amax history
and scales, checkpointed as fp8/<linear>.fp8_amax_history / .fp8_scales DCP entries) is saved
and restored, so a run stopped by --exit-interval resumes bit-identically; an FP8 run's
checkpoint loads into a run without FP8 (which ignores the FP8 state), and that run's
checkpoint loads into an FP8 run (whose scales start afresh)."""

import pytest

from megalite.checkpoint.dcp.checkpoint import read_tracker
from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
from tests.training.launch import BASE, run, train_losses

ITERS = 6
FP8 = ["--fp8-format", "hybrid", "--fp8-amax-history-len", "4", "--fp8-amax-compute-algo", "max"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--eval-iters", "0", "--eval-interval", "1000"]


def _args(tmp, *extra, fp8=True, iters=ITERS):
    return BASE + TP2_SP + (FP8 if fp8 else []) + ["--train-iters", str(iters),
                                                   "--metrics-file", str(tmp / "metrics.jsonl"), *extra]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp8_uninterrupted")
    ranks = run(_args(tmp), 2, tmp / "logs")
    losses = train_losses(tmp / "metrics.jsonl")
    assert sorted(losses) == list(range(1, ITERS + 1)), ranks.output()
    return losses


def test_fp8_run_resumes_bit_identically_and_its_checkpoint_loads_without_fp8(tmp_path, uninterrupted):
    ckpt = tmp_path / "ckpt"
    run(_args(tmp_path, "--exit-interval", "3", "--save", str(ckpt)), 2, tmp_path / "logs")
    assert read_tracker(ckpt) == 3
    saved = MegaliteCheckpoint(ckpt, 3)
    fp8_keys = [k for k in saved.keys() if k.startswith("fp8/")]
    # 4 layers x 4 linears x (history, scales)
    assert len(fp8_keys) == 32 and "fp8/layers.3.mlp.linear_fc2.fp8_scales" in fp8_keys, fp8_keys
    shape, _ = saved.spec("fp8/layers.0.self_attention.linear_qkv.fp8_amax_history")
    assert tuple(shape) == (4, 3)

    run(_args(tmp_path, "--load", str(ckpt), "--save", str(ckpt)), 2, tmp_path / "logs2")
    assert train_losses(tmp_path / "metrics.jsonl") == uninterrupted  # bit-identical, every iteration

    # the FP8 checkpoint (iteration 6) into a run without FP8, which saves at iteration 8
    plain = tmp_path / "plain"
    plain.mkdir()
    ranks = run(_args(plain, "--load", str(ckpt), "--save", str(plain / "ckpt"), "--override-opt_param-scheduler",
                fp8=False, iters=8), 2, plain / "logs")
    losses = train_losses(plain / "metrics.jsonl")
    assert sorted(losses) == [7, 8], ranks.output()
    assert not any(k.startswith("fp8/") for k in MegaliteCheckpoint(plain / "ckpt", 8).keys())

    # and that checkpoint into an FP8 run: no FP8 state stored, the scales start at 1
    again = tmp_path / "again"
    again.mkdir()
    ranks = run(_args(again, "--load", str(plain / "ckpt"), "--override-opt_param-scheduler",
                fp8=True, iters=9), 2, again / "logs")
    assert sorted(train_losses(again / "metrics.jsonl")) == [9], ranks.output()
