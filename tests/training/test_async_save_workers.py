"""--async-save with evaluation and DataLoader workers (issue 24, item 5). Toy runs with
validation and test sets, --num-workers 1 and a checkpoint every two iterations used to hang
(6 of 11): the test set's loader forked its workers while the last checkpoint was written in a
background thread, a worker deadlocked in torch.set_num_threads, and iter_*.tmp was never
published. Now every loader forks before any save (Trainer.data_iterator).

The default test runs such a job once under fork_watch.py, which fails a rank that forks
loader workers during a background write (slowed so the window is wide): it fails
deterministically without the fix, so one run is enough. The slow one repeats the plain job as the issue ran it."""

import pytest

from megalite.checkpoint.dcp.checkpoint import TRACKER, read_tracker
from tests.training.launch import BASE, drop_flags, eval_losses, run

ITERS = 4
JOB = drop_flags(BASE, "--num-workers") + [
    "--num-workers", "1", "--train-iters", str(ITERS), "--eval-interval", "2", "--eval-iters", "1",
    "--save-interval", "2", "--async-save", "--split", "90,5,5"]
WATCH = ("tests/training/fork_watch.py", "1.0")  # each background write waits a second


def _run_and_check(tmp, world_size, extra=(), program=None):
    ckpt = tmp / "ckpt"
    args = JOB + ["--save", str(ckpt), "--metrics-file", str(tmp / "metrics.jsonl"), *extra]
    run(args, world_size, tmp / "logs", timeout=120, **({"program": program} if program else {}))
    assert not list(ckpt.glob("iter_*.tmp")), f"unpublished checkpoints: {list(ckpt.glob('iter_*.tmp'))}"
    assert sorted(p.name for p in ckpt.glob("iter_*")) == ["iter_0000002", "iter_0000004"]
    assert read_tracker(ckpt) == ITERS, (ckpt / TRACKER).read_text()
    assert set(eval_losses(tmp / "metrics.jsonl", "valid")) == {2, 4}
    assert set(eval_losses(tmp / "metrics.jsonl", "test")) == {ITERS}


def test_no_loader_forks_during_a_background_save(tmp_path):
    _run_and_check(tmp_path, 2, program=WATCH)


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(8))
def test_async_save_runs_with_eval_and_workers_exit(tmp_path, attempt):
    """Four processes at TP=2 DP=2, the job as the issue ran it, eight times."""
    _run_and_check(tmp_path, 4, ["--tensor-model-parallel-size", "2"])
