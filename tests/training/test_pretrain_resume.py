"""The training driver end to end (`python -m megalite.pretrain_gpt`, four rank processes on
gloo): exact resume after --exit-interval, SIGTERM and SIGKILL at TP=2 PP=2 with dropout on;
resharding a TP=2 PP=2 checkpoint onto TP=1 DP=4 with the distributed optimizer switched on;
a dead rank makes the others exit instead of hang; bad options stop before any process group."""

import os
import re
import shutil
import signal
import time

import pytest

from megalite.checkpoint.dcp.checkpoint import read_tracker
from tests.training.launch import BASE, eval_losses, launch, run, train_losses, wait_for

ITERS = 8
TP2_PP2 = ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
           "--hidden-dropout", "0.1", "--attention-dropout", "0.1", "--train-iters", str(ITERS),
           "--eval-iters", "0", "--eval-interval", "1000"]


def _args(tmp, *extra):
    return BASE + TP2_PP2 + ["--metrics-file", str(tmp / "metrics.jsonl"), *extra]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("uninterrupted")
    run(_args(tmp), 4, tmp / "logs")
    losses = train_losses(tmp / "metrics.jsonl")
    assert sorted(losses) == list(range(1, ITERS + 1))
    return losses


def _resume_and_compare(tmp, uninterrupted, stopped_at):
    assert 1 <= stopped_at < ITERS, f"the interruption should stop the run early (stopped at {stopped_at})"
    run(_args(tmp, "--load", str(tmp / "ckpt"), "--save", str(tmp / "ckpt")), 4, tmp / "logs2")
    resumed = train_losses(tmp / "metrics.jsonl")
    assert resumed == uninterrupted  # bit-identical floats, every iteration


def test_exact_resume_after_exit_interval(tmp_path, uninterrupted):
    """(The checkpoint is written in the background: --async-save.)"""
    run(_args(tmp_path, "--exit-interval", "3", "--save", str(tmp_path / "ckpt"), "--async-save"), 4,
        tmp_path / "logs")
    assert read_tracker(tmp_path / "ckpt") == 3
    _resume_and_compare(tmp_path, uninterrupted, 3)


def test_exact_resume_after_sigterm_to_one_rank(tmp_path, uninterrupted):
    ranks = launch(_args(tmp_path, "--save", str(tmp_path / "ckpt")), 4, tmp_path / "logs")
    wait_for(lambda: len(train_losses(tmp_path / "metrics.jsonl")) >= 2, what="iteration 2", ranks=ranks)
    ranks.procs[1].send_signal(signal.SIGTERM)  # Slurm signals every task; one is enough
    assert ranks.wait() == [0, 0, 0, 0], ranks.output()
    stopped = read_tracker(tmp_path / "ckpt")
    assert max(train_losses(tmp_path / "metrics.jsonl")) == stopped
    _resume_and_compare(tmp_path, uninterrupted, stopped)


@pytest.mark.slow
def test_exact_resume_after_sigkill_following_a_checkpoint(tmp_path, uninterrupted):
    ranks = launch(_args(tmp_path, "--save", str(tmp_path / "ckpt"), "--save-interval", "3"), 4, tmp_path / "logs")
    wait_for(lambda: read_tracker(tmp_path / "ckpt") == 3 and len(train_losses(tmp_path / "metrics.jsonl")) >= 4,
             what="a checkpoint and one more iteration", ranks=ranks)
    ranks.kill()  # SIGKILL: no handler runs
    stopped = read_tracker(tmp_path / "ckpt")
    _resume_and_compare(tmp_path, uninterrupted, stopped)


@pytest.mark.slow
def test_reshard_tp2_pp2_to_tp1_dp4_with_distributed_optimizer(tmp_path):
    common = BASE + ["--train-iters", str(ITERS), "--eval-interval", "4", "--eval-iters", "2",
                     "--hidden-dropout", "0", "--attention-dropout", "0"]
    original = tmp_path / "original"
    run(common + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                  "--save", str(original / "ckpt"), "--save-interval", "4",
                  "--metrics-file", str(original / "metrics.jsonl")], 4, original / "logs")
    resharded = tmp_path / "resharded"
    (resharded / "ckpt").mkdir(parents=True)
    shutil.copytree(original / "ckpt" / "iter_0000004", resharded / "ckpt" / "iter_0000004")
    (resharded / "ckpt" / "latest_checkpointed_iteration.txt").write_text("4")
    run(common + ["--use-distributed-optimizer", "--load", str(resharded / "ckpt"),
                  "--metrics-file", str(resharded / "metrics.jsonl")], 4, resharded / "logs")
    a, b = train_losses(original / "metrics.jsonl"), train_losses(resharded / "metrics.jsonl")
    assert sorted(b) == list(range(5, ITERS + 1))
    for it in b:
        assert abs(b[it] - a[it]) <= 1e-5 * abs(a[it]), f"iteration {it}: {b[it]} vs {a[it]}"
    va, vb = eval_losses(original / "metrics.jsonl"), eval_losses(resharded / "metrics.jsonl")
    assert abs(vb[ITERS] - va[ITERS]) <= 1e-5 * abs(va[ITERS]), (va, vb)
    assert abs(eval_losses(resharded / "metrics.jsonl", "test")[ITERS]
               - eval_losses(original / "metrics.jsonl", "test")[ITERS]) <= 1e-5 * va[ITERS]


def test_dead_rank_makes_the_others_exit(tmp_path):
    """Each survivor exits with status 1 and one line on stderr: its rank, the collective that
    failed and why (no traceback: the dead rank, not the survivor's code, is the cause)."""
    args = _args(tmp_path, "--distributed-timeout-minutes", "0.5")
    args[args.index("--train-iters") + 1] = "100000"
    ranks = launch(args, 4, tmp_path / "logs", separate_stderr=True)
    wait_for(lambda: len(train_losses(tmp_path / "metrics.jsonl")) >= 2, what="iteration 2", ranks=ranks)
    ranks.procs[2].kill()
    start = time.time()
    codes = ranks.wait(timeout=120)
    assert time.time() - start < 30 + 20, "survivors outlived --distributed-timeout-minutes"
    assert codes == [1, 1, -signal.SIGKILL, 1], ranks.output()
    for rank in (0, 1, 3):
        lines = ranks.stderr(rank).splitlines()
        assert len(lines) == 1 and re.fullmatch(rf"pretrain_gpt: rank {rank}: lost a peer rank: \w+ failed "
                                                r"\(.*(Connection (closed|reset) by peer|Timed out).*\); stopping",
                                                lines[0]), ranks.output()


def test_impossible_layout_stops_every_rank_before_any_process_group(tmp_path):
    """One line naming the flags and numbers, exit status 2, and no rendezvous attempted (the
    master port is unusable). Other bad options are covered in test_arguments.py."""
    args = BASE + ["--train-iters", "2", "--tensor-model-parallel-size", "3", "--save", str(tmp_path / "ckpt")]
    ranks = launch(args, 2, tmp_path / "logs", env={"MASTER_PORT": "1"})
    assert ranks.wait(timeout=120) == [2, 2]
    for log in ranks.logs:
        lines = [ln for ln in log.read_text().splitlines() if "error" in ln]
        assert lines == ["pretrain_gpt: error: world size 2 is not divisible by --tensor-model-parallel-size 3 "
                         "x --pipeline-model-parallel-size 1 = 3"], log.read_text()
    assert not os.path.exists(tmp_path / "ckpt")


def test_splits_without_data_are_skipped_on_every_stage(tmp_path):
    """Validation and test splits with no documents: every pipeline stage (the middle ones
    build no datasets) agrees to skip evaluation instead of waiting for activations."""
    args = BASE + ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2",
                   "--train-iters", "3", "--eval-interval", "1", "--eval-iters", "2", "--split", "100,0,0",
                   "--metrics-file", str(tmp_path / "metrics.jsonl")]
    run(args, 4, tmp_path / "logs", timeout=180)
    assert sorted(train_losses(tmp_path / "metrics.jsonl")) == [1, 2, 3]
    assert eval_losses(tmp_path / "metrics.jsonl") == {}
