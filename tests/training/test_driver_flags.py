"""Driver flags end to end, each run checking several (two rank processes on gloo):

- --no-load-optim and --no-load-rng on a checkpoint holding optimizer and RNG state, stopped
  by --exit-duration-in-mins;
- --fp16 through the executor's loss scale with the distributed optimizer, --overlap-grad-reduce,
  --overlap-param-gather, --optimizer-cpu-offload and --log-params-norm over DP shards;
- --finetune into FSDP2 (--use-torch-fsdp2), stopped by SIGUSR1.

The checkpoint comes from the shared `trained_run` (conftest.py: TP=2, 6 iterations, saved at
4 and 6, dropout on).
"""

import json
import math
import re
import signal

import pytest

from megalite.checkpoint.dcp.checkpoint import iteration_dir, read_tracker
from megalite.training.metrics import read_metrics
from tests.training.launch import BASE, checkpoint_norm, copy_checkpoint, launch, run, train_losses, wait_for


def _records(metrics) -> dict:
    return read_metrics(str(metrics))[0]


def _saved_optimizer_steps(ckpt, iteration: int) -> int:
    return json.loads((iteration_dir(ckpt, iteration) / "common.json").read_text())["optimizer"]["step"]


@pytest.mark.slow
def test_no_load_optim_no_load_rng_and_exit_duration(trained_run, tmp_path):
    """From iteration 4: weights, iteration and consumed samples load; optimizer, scheduler
    (as in Megatron) and RNG start afresh. The tiny --exit-duration-in-mins (counted from the
    process start) stops the run after its first iteration, saving it."""
    load = copy_checkpoint(trained_run.ckpt, 4, tmp_path / "load")
    ranks = run(BASE + ["--tensor-model-parallel-size", "2", "--train-iters", "6", "--eval-iters", "0",
                        "--load", str(load), "--no-load-optim", "--no-load-rng", "--save", str(tmp_path / "out"),
                        "--exit-duration-in-mins", "1e-4", "--metrics-file", str(tmp_path / "metrics.jsonl"),
                        "--exit-reason-file", str(tmp_path / "reason.txt")], 2, tmp_path / "logs")
    records, trained = _records(tmp_path / "metrics.jsonl"), _records(trained_run.metrics)
    assert sorted(records) == [5] and records[5]["consumed_samples"] == trained[5]["consumed_samples"]
    assert records[5]["learning_rate"] == trained[1]["learning_rate"]    # a fresh scheduler
    # Same weights and tokens as the run that saved it; only dropout's random state differs.
    assert records[5]["lm_loss"] != trained[5]["lm_loss"]
    assert abs(records[5]["lm_loss"] - trained[5]["lm_loss"]) < 0.05
    assert read_tracker(tmp_path / "out") == 5
    assert _saved_optimizer_steps(tmp_path / "out", 5) == 1              # 5 had the state loaded
    assert (tmp_path / "reason.txt").read_text() == "exit-duration-in-mins\n"
    assert "stopping at iteration 5 (exit-duration-in-mins)" in ranks.output()


INITIAL_SCALE = 2.0**22  # the first backward overflows fp16 at this scale (at 2**16 it does not)
FP16_ITERS = 8
FP16 = BASE + ["--fp16", "--initial-loss-scale", str(INITIAL_SCALE), "--hysteresis", "1", "--use-distributed-optimizer",
               "--optimizer-cpu-offload", "--train-iters", str(FP16_ITERS), "--eval-iters", "0"]
OVERLAP = ["--overlap-grad-reduce", "--overlap-param-gather"]


@pytest.fixture(scope="module")
def fp16_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fp16")
    ranks = run(FP16 + OVERLAP + ["--log-params-norm", "--save", str(tmp / "ckpt"),
                                  "--metrics-file", str(tmp / "metrics.jsonl")], 2, tmp / "logs")
    return tmp, ranks.logs[0].read_text()


def test_fp16_loss_scale_distributed_optimizer_overlap_and_offload(fp16_run):
    """The executor multiplies the loss by the scale: at 2**22 the first backward overflows
    (unscaled it could not), the step is skipped and the scale halves (--hysteresis 1), as it
    does after every later overflow, until steps succeed."""
    tmp, log = fp16_run
    records = _records(tmp / "metrics.jsonl")
    assert sorted(records) == list(range(1, FP16_ITERS + 1))
    assert all(math.isfinite(r["lm_loss"]) for r in records.values())
    assert records[1]["skipped_iterations"] == 1
    scale = INITIAL_SCALE
    for it, record in sorted(records.items()):
        scale /= 2 if record["skipped_iterations"] else 1
        assert record["loss_scale"] == scale, (it, record)
    stepped = [it for it, r in records.items() if r["skipped_iterations"] == 0]
    assert len(stepped) >= 3, records
    assert all(0 < records[it]["grad_norm"] < 10 for it in stepped)
    assert records[stepped[-1]]["lm_loss"] < records[1]["lm_loss"] - 0.1
    assert re.search(r"^memory \(rank 0\): .* host \(cpu\): optimizer ", log, re.M), log[-3000:]


def test_params_norm_counts_each_distributed_optimizer_shard_once(fp16_run):
    """Each DP rank holds half of the fp32 main parameters: the norm adds both halves."""
    tmp, _ = fp16_run
    expected = checkpoint_norm(tmp / "ckpt", FP16_ITERS, "optimizer/param/")
    logged = _records(tmp / "metrics.jsonl")[FP16_ITERS]["params_norm"]
    assert abs(logged - expected) <= 1e-9 * expected, (logged, expected)


@pytest.mark.slow
def test_overlap_flags_change_no_loss(fp16_run, tmp_path):
    tmp, _ = fp16_run
    run(FP16 + ["--metrics-file", str(tmp_path / "metrics.jsonl")], 2, tmp_path / "logs")
    assert train_losses(tmp_path / "metrics.jsonl") == train_losses(tmp / "metrics.jsonl")


def test_finetune_into_fsdp2_stopped_by_sigusr1(trained_run, tmp_path):
    """--finetune loads only the weights (TP=2 -> FSDP2 over DP=2) and counts from iteration
    0: the checkpoint SIGUSR1 makes it save is its iteration k, with k optimizer steps."""
    args = BASE + [
        "--use-torch-fsdp2", "--load", str(trained_run.ckpt), "--finetune",
        "--train-iters", "1000", "--eval-iters", "0", "--save", str(tmp_path / "out"),
        "--metrics-file", str(tmp_path / "metrics.jsonl"), "--exit-reason-file", str(tmp_path / "reason.txt")]
    ranks = launch(args, 2, tmp_path / "logs")
    wait_for(lambda: len(train_losses(tmp_path / "metrics.jsonl")) >= 2, what="iteration 2", ranks=ranks)
    ranks.procs[1].send_signal(signal.SIGUSR1)
    assert ranks.wait() == [0, 0], ranks.output()
    records, trained = _records(tmp_path / "metrics.jsonl"), _records(trained_run.metrics)
    stopped = read_tracker(tmp_path / "out")
    assert sorted(records) == list(range(1, stopped + 1)) and records[1]["consumed_samples"] == 8
    assert records[1]["learning_rate"] == trained[1]["learning_rate"]
    assert records[1]["lm_loss"] < trained[1]["lm_loss"] - 0.1              # trained weights, same tokens
    assert all(math.isfinite(r["lm_loss"]) for r in records.values())
    assert _saved_optimizer_steps(tmp_path / "out", stopped) == stopped
    assert (tmp_path / "reason.txt").read_text() == "signal SIGUSR1\n"
    log = ranks.logs[0].read_text()
    assert f"stopping at iteration {stopped} (signal SIGUSR1)" in log and "memory (rank 0): " in log
    assert "FSDP2" in log
