"""Console lines as Megatron prints them, the JSON-lines metrics file, TensorBoard and wandb."""

import glob
import json
import math
import os
import time
from datetime import datetime
from types import SimpleNamespace

import pytest
import torch

from megalite.config.arguments import parse_args
from megalite.config.run_config import LoggingConfig
from megalite.training.metrics import (MetricsLogger, TrainingRecord, format_evaluation_lines,
                                       format_training_line, memory_usage_mb, throughput)

LOSS = 2.718281828459045     # full precision must survive the metrics file


def record(iteration=10, **overrides):
    values = dict(iteration=iteration, train_iters=100, consumed_samples=640,
                  elapsed_ms_per_iteration=123.456, learning_rate=3e-4, global_batch_size=64,
                  lm_loss=LOSS, loss_scale=1.0, grad_norm=1.23456, skipped_iterations=0,
                  nan_iterations=1, tokens_per_second_per_gpu=5432.1, tflops_per_gpu=12.345,
                  mfu=0.4123, memory_mb=2048.0, memory_kind="cuda_max_allocated")
    values.update(overrides)
    return TrainingRecord(**values)


def test_training_line_is_megatrons():
    line = format_training_line(record(), now=datetime(2026, 11, 21, 9, 5, 7))
    assert line == (
        " [2026-11-21 09:05:07] iteration       10/     100 | consumed samples:          640 |"
        " elapsed time per iteration (ms): 123.5 | throughput per GPU (TFLOP/s/GPU): 12.3 |"
        " MFU: 41.2% | tokens per second per GPU: 5432.1 | learning rate: 3.000000E-04 |"
        " global batch size:    64 | lm loss: 2.718282E+00 | loss scale: 1.0 |"
        " grad norm: 1.235 | number of skipped iterations:   0 | number of nan iterations:   1 |"
        " max allocated memory (MB): 2048.0 |")
    cpu = format_training_line(record(mfu=None, memory_kind="max_rss", grad_norm=None))
    assert "MFU: n/a (unknown device peak) |" in cpu and "max RSS memory (MB): 2048.0 |" in cpu
    assert "grad norm" not in cpu


def test_fp8_run_states_mfu_against_both_peaks():
    """An --fp8-format run's line names both peaks; a 16-bit run's (mfu_fp8 None) is unchanged."""
    rates = throughput(flops_per_token=1e9, tokens_per_iteration=64 * 1024, seconds_per_iteration=0.5,
                       world_size=8, peak_flops=989.4e12, peak_fp8_flops=1978.9e12)
    assert rates["mfu_fp8"] == pytest.approx(16.384e12 / 1978.9e12, rel=1e-12)
    assert rates["mfu"] == pytest.approx(2 * rates["mfu_fp8"], rel=1e-4)
    fp8 = format_training_line(record(mfu=rates["mfu"], mfu_fp8=rates["mfu_fp8"]))
    assert " MFU: 1.7% of the bf16 peak, 0.8% of the FP8 peak |" in fp8
    assert fp8.count("MFU") == 1
    without = throughput(1e9, 64 * 1024, 0.5, 8, 989.4e12)
    assert without["mfu_fp8"] is None
    assert format_training_line(record(**without)).count(" MFU: 1.7% |") == 1


def test_evaluation_block():
    text = format_evaluation_lines("valid", 200, 3.0)
    rule, line, rule2 = text.split("\n")
    assert line == (" validation loss at iteration 200 | lm loss value: 3.000000E+00 | "
                    f"lm loss PPL: {math.exp(3.0):.6E} | ")
    assert rule == rule2 == "-" * (len(line) + 1)
    assert "test loss at iteration 7" in format_evaluation_lines("test", 7, 30.0)
    assert f"{math.exp(20):.6E}" in format_evaluation_lines("test", 7, 30.0)  # Megatron's cap


def read_jsonl(path):
    with open(path) as handle:
        return [json.loads(line) for line in handle]


def test_metrics_file_records_and_resume(tmp_path):
    path = str(tmp_path / "run" / "metrics.jsonl")
    printed = []
    with MetricsLogger(True, metrics_file=path, print_fn=printed.append) as logger:
        line = logger.log_training(record(10, lm_loss=torch.tensor(LOSS, dtype=torch.float64)))
        logger.log_training(record(20, grad_norm=None))
        logger.log_evaluation("valid", 20, torch.tensor(1.5, dtype=torch.float64))
        logger.log_training(record(30))
        assert read_jsonl(path)[-1]["iteration"] == 30          # flushed line by line
    assert printed[0] == line and len(printed) == 4
    records = read_jsonl(path)
    assert [r["iteration"] for r in records] == [10, 20, 20, 30]
    assert records[0]["lm_loss"] == LOSS and type(records[0]["lm_loss"]) is float
    assert records[0]["consumed_samples"] == 640 and records[0]["mfu"] == 0.4123
    assert records[1]["grad_norm"] is None and "split" not in records[1]
    assert records[2] == {"split": "valid", "iteration": 20, "lm_loss": 1.5,
                          "lm_loss_ppl": math.exp(1.5), "time": records[2]["time"]}
    # resumed from the checkpoint of iteration 20: later records go, new ones are appended
    with MetricsLogger(True, metrics_file=path, resume_iteration=20, print_fn=printed.append) as logger:
        logger.log_training(record(30, lm_loss=1.25))
        logger.log_evaluation("test", 30, 1.0)
    records = read_jsonl(path)
    assert [(r["iteration"], r.get("split")) for r in records] == \
        [(10, None), (20, None), (20, "valid"), (30, None), (30, "test")]
    assert records[3]["lm_loss"] == 1.25


def test_only_the_writing_rank_writes(tmp_path):
    printed = []
    logger = MetricsLogger(False, metrics_file=str(tmp_path / "m.jsonl"),
                           tensorboard_dir=str(tmp_path / "tb"), wandb_project="never",
                           print_fn=printed.append)
    assert logger.log_training(record()) is None and logger.log_evaluation("valid", 1, 1.0) is None
    logger.close()
    assert printed == [] and os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="'valid' or 'test'"):
        logger.log_evaluation("train", 1, 1.0)


def test_corrupt_metrics_file_is_named_on_resume(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text('{"iteration": 1, "lm_loss": 2.0}\n{"iteration": 2, "lm_lo\n')
    with pytest.raises(ValueError, match=f"{path}:2"):
        MetricsLogger(True, metrics_file=str(path), resume_iteration=1)


def test_from_config_wires_the_options(tmp_path):
    logging = LoggingConfig.from_args(parse_args(["--metrics-file", str(tmp_path / "m.jsonl")]))
    with MetricsLogger.from_config(logging, {}, should_write=True, print_fn=lambda text: None) as logger:
        logger.log_evaluation("valid", 5, 2.0)
    assert read_jsonl(logging.metrics_file)[0]["iteration"] == 5


def test_throughput_and_memory():
    numbers = throughput(flops_per_token=1e9, tokens_per_iteration=64 * 1024,
                         seconds_per_iteration=0.5, world_size=8, peak_flops=989.4e12)
    assert numbers["tokens_per_second_per_gpu"] == 64 * 1024 / 0.5 / 8 == 16384
    assert numbers["tflops_per_gpu"] == pytest.approx(16.384, rel=1e-12)
    assert numbers["mfu"] == pytest.approx(16.384e12 / 989.4e12, rel=1e-12)
    assert throughput(1e9, 1024, 1.0, 1, None)["mfu"] is None
    megabytes, kind = memory_usage_mb(torch.device("cpu"))
    assert kind == "max_rss" and 10 < megabytes < 1e6


def test_tensorboard_scalars(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(True, tensorboard_dir=str(tmp_path), print_fn=lambda text: None) as logger:
        logger.log_training(record(10))
        logger.log_training(record(20, lm_loss=1.5))
        logger.log_evaluation("valid", 20, 1.25)
    events = EventAccumulator(str(tmp_path))
    events.Reload()
    losses = [(e.step, e.value) for e in events.Scalars("train/lm_loss")]
    assert losses == [(10, pytest.approx(LOSS, rel=1e-6)), (20, 1.5)]
    assert [(e.step, e.value) for e in events.Scalars("valid/lm_loss")] == [(20, 1.25)]
    assert "train/learning_rate" in events.Tags()["scalars"]


def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with MetricsLogger(True, wandb_project="megalite-test", wandb_exp_name="offline",
                       wandb_save_dir=str(tmp_path), run_config={"lr": 3e-4},
                       print_fn=lambda text: None) as logger:
        logger.log_training(record(10))
        logger.log_evaluation("valid", 10, 1.25)
    runs = glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "*.wandb"))
    assert len(runs) == 1
    # wandb's service process may finish writing the run file just after finish() returns
    deadline = time.monotonic() + 20
    while True:
        data = open(runs[0], "rb").read()       # protobuf records: the keys appear verbatim
        if (b"train/lm_loss" in data and b"valid/lm_loss" in data) or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert b"train/lm_loss" in data and b"valid/lm_loss" in data
