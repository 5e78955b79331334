"""Megatron's logging flags and the training-loop flags that only show in a whole run.

One driver run (two rank processes, DP = 2, on gloo) with most of them on is shared by the
end-to-end assertions: the TensorBoard tags each flag writes (read back with TensorBoard's
EventAccumulator), the ramp-up's batch size per iteration, progress.txt, the torch.profiler
trace, --timing-log-option max, --log-straggler, --log-num-zeros-in-grad,
--eval-global-batch-size, --check-weight-hash-across-dp-replicas-interval and the start-up
lines. The flags whose default is on (--no-log-loss-scale-to-tensorboard,
--no-log-learning-rate-to-tensorboard) are checked in-process on MegatronTensorboard.
"""

import json
import math
import re
import sys
import types
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from megalite.checkpoint.dcp.checkpoint import iteration_dir
from megalite.config.arguments import parse_args
from megalite.config.run_config import LoggingConfig, TrainingConfig
from megalite.training.metrics import MetricsLogger, read_metrics
from megalite.training.run_hooks import RunHooks
from megalite.training.tensorboard_log import MegatronTensorboard
from megalite.training.timers import Timers
from tests.training.launch import BASE, drop_flags, run

pytest.importorskip("tensorboard")
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

LOGGING = [
    "--log-validation-ppl-to-tensorboard", "--log-timers-to-tensorboard", "--log-memory-to-tensorboard",
    "--log-world-size-to-tensorboard", "--log-batch-size-to-tensorboard", "--log-num-zeros-in-grad",
    "--tensorboard-log-interval", "2", "--tensorboard-queue-size", "5", "--log-progress",
    "--timing-log-level", "1", "--timing-log-option", "max", "--log-straggler", "--log-interval", "2",
]
TRAINING = [
    "--rampup-batch-size", "4", "4", "8", "--train-samples", "32", "--lr-warmup-samples", "8",
    "--eval-global-batch-size", "4",
    "--eval-iters", "1", "--eval-interval", "4", "--profile", "--profile-step-start", "1", "--profile-step-end", "3",
    "--profile-ranks", "0", "--check-weight-hash-across-dp-replicas-interval", "2", "--manual-gc",
    "--manual-gc-interval", "2", "--sequence-parallel", "--ddp-average-in-collective",
]
# Ramp-up from 4 by 4 over 8 samples to 8 (one increment per 8 samples), 32 samples: batches 4 at 0
# and 4 consumed samples, 4 + int(8 / 8) x 4 = 8 at 8, then 8: three ramp-up iterations (to 16
# samples) and (32 - 16) / 8 = 2 more, as Megatron counts them.
RAMP = [4, 4, 8, 8, 8]


@pytest.fixture(scope="module")
def logged_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron_logging")
    argv = drop_flags(BASE, "--global-batch-size", "--log-interval", "--lr-warmup-iters") + LOGGING + TRAINING + [
        "--global-batch-size", "8", "--tensorboard-dir", str(root / "tb"), "--save", str(root / "ckpt"),
        "--metrics-file", str(root / "metrics.jsonl")]
    ranks = run(argv, 2, root / "logs")
    output = "\n".join(Path(log).read_text() for log in ranks.logs)
    events = EventAccumulator(str(root / "tb"))
    events.Reload()
    return SimpleNamespace(root=root, output=output, events=events, argv=argv)


def _scalars(events, tag):
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_rampup_batch_size_changes_the_batch_per_iteration(logged_run):
    records = read_metrics(str(logged_run.root / "metrics.jsonl"))[0]
    assert sorted(records) == [2, 4]  # --log-interval 2
    assert [records[i]["consumed_samples"] for i in (2, 4)] == [sum(RAMP[:2]), sum(RAMP[:4])]
    assert [records[i]["global_batch_size"] for i in (2, 4)] == [RAMP[1], RAMP[3]]
    assert _scalars(logged_run.events, "batch-size") == [(2, 4.0), (4, 8.0)]


@pytest.mark.parametrize("flag, tags", [
    ("--log-validation-ppl-to-tensorboard", ["lm loss validation ppl", "lm loss validation ppl vs samples"]),
    ("--log-timers-to-tensorboard", ["iteration-time", "forward-backward-time", "optimizer-time"]),
    ("--log-memory-to-tensorboard", ["mem-max-rss-bytes"]),
    ("--log-world-size-to-tensorboard", ["world-size", "world-size vs samples"]),
    ("--log-batch-size-to-tensorboard", ["batch-size", "batch-size vs samples"]),
    ("--log-num-zeros-in-grad", ["num-zeros", "num-zeros vs samples"]),
    ("(default on)", ["lm loss", "learning-rate", "loss-scale", "grad-norm", "lm loss validation"]),
])
def test_each_tensorboard_flag_writes_its_scalars(logged_run, flag, tags):
    present = logged_run.events.Tags()["scalars"]
    assert all(tag in present for tag in tags), (flag, sorted(present))


def test_tensorboard_log_interval_and_values(logged_run):
    events = logged_run.events
    assert [s for s, _ in _scalars(events, "lm loss")] == [2, 4]        # --tensorboard-log-interval 2
    assert _scalars(events, "world-size") == [(2, 2.0), (4, 2.0)]
    records = read_metrics(str(logged_run.root / "metrics.jsonl"))[0]
    # TensorBoard gets each logged iteration's own loss (the metrics file the window's mean)
    assert all(abs(value - records[4]["lm_loss"]) < 0.5 for _, value in _scalars(events, "lm loss"))
    assert records[4]["num_zeros"] == _scalars(events, "num-zeros")[-1][1]
    ppl = dict(_scalars(events, "lm loss validation ppl"))
    loss = dict(_scalars(events, "lm loss validation"))
    assert ppl and all(ppl[s] == pytest.approx(math.exp(loss[s]), rel=1e-5) for s in ppl)
    assert "num zeros:" in logged_run.output


def test_log_progress_writes_megatrons_lines(logged_run):
    lines = (logged_run.root / "ckpt" / "progress.txt").read_text().splitlines()
    stamp = r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\tJob ID: [^\t]*\t# GPUs: 2\t"
    assert re.fullmatch(stamp + "Starting job", lines[0]), lines
    assert re.fullmatch(stamp + r"Saved checkpoint\tIteration: 5\tJob throughput: \d+\.\d TFLOP/s/GPU\t"
                        r"Cumulative throughput: \d+\.\d TFLOP/s/GPU\tFloating-point operations: \d\.\d\de\+\d\d\t"
                        r"Tokens \(in billions\): 0\.00", lines[1]), lines
    assert len(lines) == 2


def test_profile_writes_a_trace_of_the_profiled_rank(logged_run):
    traces = sorted(p.name for p in (logged_run.root / "tb").glob("*.pt.trace.json"))
    assert len(traces) == 1 and traces[0].startswith("rank0."), traces
    trace = json.loads(next((logged_run.root / "tb").glob("*.pt.trace.json")).read_text())
    assert any("ProfilerStep" in e.get("name", "") or e.get("ph") == "X" for e in trace["traceEvents"])


def test_timing_option_straggler_and_startup_lines(logged_run):
    out = logged_run.output
    assert "max time across ranks (ms):" in out and "(min, max) time across ranks" not in out
    assert re.search(r"straggler report \(forward-backward ms per iteration\): slowest rank [01] [\d.]+ \| "
                     r"fastest rank [01] [\d.]+ \| slowest/fastest [\d.]+ \| 0:[\d.]+ 1:[\d.]+", out)
    assert "--sequence-parallel: no effect at --tensor-model-parallel-size 1" in out
    assert "--ddp-average-in-collective: megalite averages gradients in the collective" in out


def test_eval_global_batch_size_sets_the_validation_samples(logged_run):
    common = json.loads((iteration_dir(logged_run.root / "ckpt", 5) / "common.json").read_text())
    # one evaluation at iteration 4 of --eval-iters 1 batch of --eval-global-batch-size 4
    assert common["consumed_valid_samples"] == 4 and common["consumed_train_samples"] == sum(RAMP)


@pytest.mark.slow
def test_deterministic_mode_gives_bit_identical_repeated_runs(tmp_path):
    argv = drop_flags(BASE, "--train-iters") + ["--train-iters", "3", "--eval-iters", "0", "--deterministic-mode",
                                                "--hidden-dropout", "0.1"]
    losses = []
    for attempt in range(2):
        run(argv + ["--metrics-file", str(tmp_path / f"m{attempt}.jsonl")], 1, tmp_path / f"logs{attempt}")
        losses.append({i: r["lm_loss"] for i, r in read_metrics(str(tmp_path / f"m{attempt}.jsonl"))[0].items()})
    assert losses[0] == losses[1] and sorted(losses[0]) == [1, 2, 3]


# --- in-process ---------------------------------------------------------------------------------

def _tb_args(tmp_path, **overrides):
    values = dict(tensorboard_dir=str(tmp_path), tensorboard_queue_size=7, tensorboard_log_interval=1,
                  log_learning_rate_to_tensorboard=True, log_batch_size_to_tensorboard=False,
                  log_loss_scale_to_tensorboard=True, log_world_size_to_tensorboard=False,
                  log_memory_to_tensorboard=False, log_timers_to_tensorboard=False,
                  log_validation_ppl_to_tensorboard=False)
    return SimpleNamespace(**{**values, **overrides})


@pytest.mark.parametrize("flag, tag", [("log_learning_rate_to_tensorboard", "learning-rate"),
                                       ("log_loss_scale_to_tensorboard", "loss-scale")])
def test_default_on_tensorboard_flags_turn_off(tmp_path, flag, tag):
    for on in (True, False):
        directory = tmp_path / str(on)
        board = MegatronTensorboard(_tb_args(directory, **{flag: on}), True)
        board.log_iteration(1, consumed_samples=8, learning_rate=1e-3, batch_size=8, loss=2.0, loss_scale=4.0)
        board.close()
        events = EventAccumulator(str(directory))
        events.Reload()
        assert (tag in events.Tags()["scalars"]) == on


def test_tensorboard_queue_size_is_the_writers_queue(tmp_path):
    board = MegatronTensorboard(_tb_args(tmp_path), True)
    assert board.writer.file_writer.event_writer._async_writer._byte_queue.maxsize == 7
    board.close()


def test_wandb_entity_reaches_wandb_init(tmp_path, monkeypatch):
    calls = []
    fake = types.ModuleType("wandb")
    fake.init = lambda **kwargs: calls.append(kwargs) or SimpleNamespace(log=lambda *a, **k: None,
                                                                           finish=lambda: None)
    monkeypatch.setitem(sys.modules, "wandb", fake)
    logging = LoggingConfig.from_args(parse_args(["--wandb-project", "p", "--wandb-exp-name", "e", "--wandb-save-dir",
                                                  str(tmp_path), "--wandb-entity", "my-team"]))
    MetricsLogger.from_config(logging, {}, should_write=True, print_fn=lambda text: None).close()
    assert calls[0]["entity"] == "my-team" and calls[0]["project"] == "p"


@pytest.mark.parametrize("option, header", [("max", "max time across ranks (ms):"),
                                            ("minmax", "(min, max) time across ranks (ms):"),
                                            ("all", "times across ranks (ms):")])
def test_timing_log_option_formats(option, header):
    timers = Timers(1, torch.device("cpu"), option)
    timers.elapsed["optimizer"] = 0.5
    text = timers.report(None, 2)
    expected = {"max": "    optimizer ......................................: 250.00",
                "minmax": "    optimizer ......................................: (250.00, 250.00)",
                "all": "  optimizer:\n     rank  0: 250.00"}[option]
    assert text == f"{header}\n{expected}" and timers.last_max_ms["optimizer"] == 250.0


def test_progress_floating_point_operations_continue_after_a_resume(tmp_path):
    args = parse_args(["--log-progress", "--save", str(tmp_path), "--seq-length", "16"])
    training, logging = TrainingConfig.from_args(args), LoggingConfig.from_args(args)
    state = SimpleNamespace(rank=0, world_size=1)
    first = RunHooks(training, logging, state, torch.device("cpu"), flops_per_sample=1e6)
    for iteration in (1, 2):
        first.after_iteration(iteration, [], 4)
    first.after_save(2, 8)
    resumed = RunHooks(training, logging, state, torch.device("cpu"), flops_per_sample=1e6, resume_iteration=2)
    resumed.after_iteration(3, [], 4)
    resumed.after_save(3, 12)
    lines = (tmp_path / "progress.txt").read_text().splitlines()
    assert [line.split("\t")[3] for line in lines] == ["Starting job", "Saved checkpoint", "Starting job",
                                                       "Saved checkpoint"]
    assert lines[1].split("\t")[7] == "Floating-point operations: 8.00e+06"
    assert lines[3].split("\t")[7] == "Floating-point operations: 1.20e+07"


def test_tensorboard_and_progress_flags_without_their_directory_say_so():
    from megalite.config.run_config import startup_notes
    from tests.config.test_arguments import parsed

    notes = startup_notes(parsed("--log-progress --log-timers-to-tensorboard", 1))
    assert "--log-progress: no --save, so no progress.txt is written (as in Megatron)" in notes
    assert any(n.startswith("--log-timers-to-tensorboard: no --tensorboard-dir") for n in notes)
