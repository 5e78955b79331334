"""tools/benchmarks/gpu_check.sh without a GPU: it says so in one line; its --cpu-smoke mode runs
every step at toy scale and ends with the table (in the default suite: CI runs it), a step over its budget
reported while the script goes on; and its reader (gpu_check_report.py) on made-up logs and
traces: the kernel classes, the GPU's idle time, the kernel rates the planner reads."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalite.planner.cli import main as plan_main
from megalite.planner.cluster import H200_KERNELS, KernelRates, preset
from megalite.planner.gpu_kernels import attention_seconds, step_traffic
from megalite.planner.layouts import Layout
from megalite.planner.parameters import rank_parameters
from megalite.planner.workload import from_flags
from tests import program_server

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tools/benchmarks/gpu_check.sh"
sys.path.insert(0, str(REPO / "tools/benchmarks"))
import gpu_check_report as report  # noqa: E402

ENV = dict(os.environ, PYTHON=sys.executable, PYTHONPATH=str(REPO))


def run(*args, env=None, timeout=900):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, cwd=REPO,
                          env=dict(ENV, **(env or {})), timeout=timeout)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU: the script would measure it")
def test_without_a_gpu_it_says_so_and_exits_0(tmp_path):
    done = run("--out", str(tmp_path / "t.md"))
    assert done.returncode == 0 and len(done.stdout.strip().splitlines()) == 1
    assert "no CUDA GPU" in done.stdout and not (tmp_path / "t.md").exists()


@pytest.mark.parametrize("args, message", [(["--frobnicate"], "unknown option --frobnicate"),
                                           (["--only", "tests,bogus"], "unknown step bogus"),
                                           (["--budget", "ten"], "--budget must be whole seconds")])
def test_bad_options_are_one_line(args, message):
    done = run(*args)
    assert done.returncode == 2 and message in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_cpu_smoke_runs_every_step_and_one_over_its_budget_is_reported(tmp_path):
    """Every step at toy scale; bench-host-overhead is given 1 s, so it is reported as timed out and
    the script goes on (it starts a fresh interpreter without Triton's and compiles kernels: seconds;
    its own run is tests/kernels/test_host_path.py's). The script's $PYTHON forks its programs from
    a server that has imported torch and megalite (tests/program_server.py; a step that changes
    Triton's mode starts a real interpreter)."""
    out = tmp_path / "check.md"
    python = program_server.python_command(tmp_path, ENV)
    done = run("--cpu-smoke", "--out", str(out), env={"BUDGET_HOST": "1", "PYTHON": python}, timeout=1500)
    assert done.returncode == 0, done.stderr[-3000:]
    table = out.read_text()
    assert "| bench-host-overhead | timed out | " in table and done.stdout.rstrip().endswith(table.rstrip().splitlines()[-1])
    assert "torch " + torch.__version__ in table and "command: `bash tools/benchmarks/gpu_check.sh --cpu-smoke" in table
    steps = ["tests-kernels", "tests-tp-cuda", "bench-kernels", "bench-attention", "run-1b",
             "run-8b-layers", "run-1b-recompute", "profile", "run-1b-compile", "run-1b-compile-graphs", "bench-fp8",
             "bench-model"]
    for name in steps:
        assert f"| {name} | ok |" in table, name
    for name in ("1b", "8b-layers", "1b-recompute"):
        row = next(line for line in table.splitlines() if line.startswith(f"| run-{name} |"))
        assert "ms/step" in row and "dry run n/a" not in row and "planner (h200) n/a" not in row, row
    fp8 = next(line for line in table.splitlines() if line.startswith("| bench-fp8 |"))
    assert "8b-layers: FP8 " in fp8 and "tokens/s" in fp8 and "loss after 3 steps" in fp8, fp8  # bench_fp8.py --cpu-smoke
    assert re.search(r"\b\d+ passed", table) and "skipped" in table  # a kernel file, the TP skips


def _kernel(name, ts, dur):
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur}


def test_profile_summary_classes_and_idle_time(tmp_path):
    trace = tmp_path / "t.json"
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5},
              _kernel("sm90_xmma_gemm_bf16bf16_bf16f32", 10, 100),
              _kernel("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<128>>", 110, 50),
              _kernel("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<>", 200, 80),
              _kernel("void pytorch_flash::flash_bwd_convert_dq_kernel<>", 280, 10),
              _kernel("_norm_bwd_kernel", 300, 20), _kernel("_swiglu_fwd_kernel", 320, 5),
              _kernel("void at::native::vectorized_elementwise_kernel<4, AddFunctor>", 330, 10),
              _kernel("void at::native::(anonymous)::multi_tensor_apply_kernel<>", 335, 15),  # overlaps the add
              _kernel("_rotary_kernel", 400, 10)]
    trace.write_text(json.dumps({"traceEvents": events}))
    summary = report.profile_summary(trace)
    assert summary["kernels"] == 9
    assert summary["classes"] == pytest.approx({"gemm": 100e-6, "attention forward": 50e-6, "attention backward": 80e-6,
                                                "attention auxiliary": 10e-6, "norm": 20e-6, "swiglu": 5e-6,
                                                "torch": 10e-6, "optimizer": 15e-6, "rotary": 10e-6})
    assert summary["span"] == pytest.approx(410e-6)
    assert summary["busy"] == pytest.approx((100 + 50 + 80 + 10 + 20 + 5 + 20 + 10) * 1e-6)  # the gap 160-200 idle


def test_rates_invert_the_traffic_model():
    """A profile whose class times are the planner's own predictions for the 1.1B run gives back
    the preset's rates: the file gpu_check.sh writes means what cluster.py's constants mean."""
    flags = ("--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --group-query-attention --num-query-groups 8 "
             "--ffn-hidden-size 8192 --swiglu --normalization RMSNorm --position-embedding-type rope "
             "--disable-bias-linear --untie-embeddings-and-output-weights --seq-length 4096 --global-batch-size 4 "
             "--bf16 --attention-backend flash --tokenizer-type NullTokenizer --vocab-size 32000").split()
    workload = from_flags(flags)
    layout = Layout(1, 1, 1, micro_batch_size=2, schedule="none")
    cluster = preset("h200", 1)
    k = cluster.kernels
    traffic = step_traffic(workload, layout)
    params = sum(rank_parameters(workload.config, 1, 1, 1, 0))
    forward, backward, aux = attention_seconds(cluster, workload, layout, 8192)
    torch_bytes = sum(traffic["torch"]) + 32 * aux * k.rate("torch") + params * 10
    seconds = {kind: sum(traffic[kind]) / k.rate(kind) for kind in ("norm", "swiglu", "rotary")}
    seconds.update({"torch": torch_bytes / k.rate("torch"), "optimizer": params * 40 / k.rate("optimizer"),
                    "attention forward": 32 * forward, "attention backward": 32 * backward, "gemm": 0.13})
    rates = report.measured_rates({"classes": seconds, "kernels": 1}, flags + ["--micro-batch-size", "2"], "h200",
                                  k.copy_bandwidth)
    assert rates["measured"] == ["attention", "norm", "optimizer", "rotary", "swiglu", "torch"]
    for name in ("attention", "norm", "swiglu", "rotary", "torch", "optimizer"):
        assert rates["kernels"][name] == pytest.approx(getattr(H200_KERNELS, name), rel=1e-9), name
    assert KernelRates.from_dict(rates["kernels"], "test").cross_entropy == H200_KERNELS.cross_entropy


def test_the_rates_file_feeds_the_planner(tmp_path, capsys):
    flags = ("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --global-batch-size 4 --bf16 "
             "--tokenizer-type NullTokenizer --vocab-size 1000 --normalization RMSNorm --swiglu "
             "--position-embedding-type rope").split()
    summary = {"classes": {"norm": 1e-3, "swiglu": 1e-3, "torch": 5e-3, "attention backward": 1e-3}, "kernels": 4}
    rates = report.measured_rates(summary, flags + ["--micro-batch-size", "2"], "h100", 3e12)
    path = tmp_path / "kernel_rates.json"
    path.write_text(json.dumps(rates))
    loaded = KernelRates.load(str(path))
    assert loaded.copy_bandwidth == 3e12 and loaded.rotary == preset("h100", 1).kernels.rotary  # not run: preset's
    assert rates["measured"] == ["attention", "norm", "swiglu", "torch"]
    assert plan_main(["--cluster", "h100", "--num-gpus", "1", "--kernel-rates", str(path), "--", *flags]) == 0
    assert "TP1 PP1 DP1" in capsys.readouterr().out


def test_logs_are_summarised(tmp_path):
    (tmp_path / "steps.tsv").write_text("tests-kernels\tok\t50\t112\nrun-1b\tfailed (exit 1)\t3\t60\n"
                                        "dry-1b\tok\t9\t120\nplan-1b\ttimed out\t60\t60\n")
    (tmp_path / "tests-kernels.xml").write_text(
        '<testsuites><testsuite tests="3" failures="1" errors="0" skipped="1">'
        '<testcase classname="tests.kernels.test_norms" name="test_a"/>'
        '<testcase classname="tests.kernels.test_norms" name="test_b"><failure message="x"/></testcase>'
        '<testcase classname="tests.kernels.test_norms" name="test_c"><skipped/></testcase></testsuite></testsuites>')
    records = [{"iteration": i, "elapsed_ms_per_iteration": ms, "mfu": 0.4, "memory_mb": 100.0 + i,
                "memory_kind": "cuda_max_allocated"} for i, ms in enumerate([900, 500, 300, 310, 305, 290, 999, 301], 1)]
    (tmp_path / "run-1b.jsonl").write_text("\n".join(json.dumps(r) for r in records))
    (tmp_path / "profiled.json").write_text('{"1b": 7}')
    (tmp_path / "dry-1b.log").write_text('noise\n{"rank": 0, "pp_rank": 0, "peak": {}, "peak_total": 110100480}\n')
    text = report.table(tmp_path, "bash gpu_check.sh", "NVIDIA H200", "h200")
    assert "| tests-kernels | ok | 50 (112) | 1 passed, 1 failed, 1 skipped: test_norms::test_b |" in text
    row = next(line for line in text.splitlines() if line.startswith("| run-1b |"))
    assert "measured 301.0 ms/step, MFU 40.0%, peak 108.0 MiB" in row  # median of iterations 3-6 and 8
    assert "dry run 105.0 MiB (-2.8%)" in row and "planner (h200) n/a" in row
    assert "| plan-1b | timed out | 60 (60) |" in text and "dry-1b" not in text.replace("dry run", "")


def test_a_killed_test_run_names_its_failures_from_the_verbose_log(tmp_path):
    """The first H100 run's kernel tests hit their budget with two failures whose names no file
    kept; the step now runs pytest -v, and without the --junitxml file the report reads the log."""
    (tmp_path / "tests-kernels.log").write_text(
        "bringing up nodes...\n"
        "[gw0] [  1%] PASSED tests/kernels/test_norms.py::test_a[cuda-bf16] \n"
        "[gw1] [  2%] FAILED tests/kernels/test_rotary.py::test_b[cuda] \n"
        "tests/kernels/test_to_dtype.py::test_c SKIPPED (no fp8)              [  3%]\n"
        "tests/kernels/test_to_dtype.py::test_d PASSED                        [  4%]\n")
    text = report.junit_summary(tmp_path / "tests-kernels.xml")
    assert text == "killed before the end: 2 passed, 1 failed, 1 skipped: test_rotary.py::test_b[cuda]"
    (tmp_path / "tests-kernels.log").write_text("......F...\n")
    assert report.junit_summary(tmp_path / "tests-kernels.xml") == "no result file; the log ends: ......F..."


def test_the_graphed_run_is_held_against_its_compiled_twin(tmp_path):
    """The compiled 1.1B runs differ in the CUDA graphs alone (both without dropout): the report
    gives their largest relative loss difference (the first H100 run, dropout in one of them
    only, left their losses 10x apart)."""
    for name, losses in (("1b-compile", [10.0, 8.0, 4.0]), ("1b-compile-graphs", [10.0, 8.0, 4.4])):
        (tmp_path / f"run-{name}.jsonl").write_text("\n".join(json.dumps(
            {"iteration": i, "lm_loss": loss, "elapsed_ms_per_iteration": 300.0, "mfu": 0.4, "memory_mb": 1.0,
             "memory_kind": "cuda_max_allocated"}) for i, loss in enumerate(losses, 1)))
    row = report.run_row(tmp_path, "1b-compile-graphs", "h100")
    assert row.endswith("; losses against 1b-compile: largest relative difference 1.0e-01 over 3 iterations")
    assert "losses against" not in report.run_row(tmp_path, "1b-compile", "h100")


def test_the_attention_benchmark_is_summarised_by_its_fastest_kernel(tmp_path):
    (tmp_path / "bench-attention.log").write_text(
        "card: NVIDIA H200\n\n| shape | kernel | fwd ms | bwd ms | fwd TFLOP/s | bwd TFLOP/s | fwd % peak | bwd % peak | check |\n"
        "|---|---|---:|---:|---:|---:|---:|---:|---|\n"
        "| driver | CUDNN_ATTENTION | 1.000 | 3.000 | 500.0 | 400.0 | 51% | 40% | ok |\n"
        "| driver | FLASH_ATTENTION | 1.500 | 4.000 | 300.0 | 250.0 | 30% | 25% | ok |\n"
        "| driver | megalite auto | 1.010 | 3.010 | 500.0 | 400.0 | 51% | 40% | ok |\n"
        "| mla | FLASH_ATTENTION (v padded) | 0.100 | 0.100 | 1.0 | 1.0 | 1% | 1% | relative error 1.0e-01 |\n"
        "| mla | CUDNN_ATTENTION | - | - | - | - | - | - | refused: head_dim should be no more than 128 |\n"
        "| mla | EFFICIENT_ATTENTION | 2.000 | 5.000 | 200.0 | 190.0 | 20% | 19% | ok |\n")
    assert report.attention_summary(tmp_path / "bench-attention.log") == (
        "driver: CUDNN_ATTENTION 1.000/3.000 ms (51%/40% of peak), auto 1.010/3.010 ms; "
        "mla: EFFICIENT_ATTENTION 2.000/5.000 ms (20%/19% of peak)")
    assert report.attention_summary(tmp_path / "missing.log") == "no log"


def test_run_metrics_reads_a_metrics_file_with_evaluation_records(tmp_path):
    """A run with --eval-interval writes evaluation records (a "split", no step time) between the
    training ones: run_metrics takes the steps alone (it parsed every line as a step before)."""
    from megalite.training.metrics import MetricsLogger, TrainingRecord

    path = tmp_path / "run-x.jsonl"
    with MetricsLogger(True, metrics_file=str(path), print_fn=lambda text: None) as logger:
        for iteration, ms in enumerate([900.0, 500.0, 110.0, 100.0, 5000.0, 120.0], 1):
            logger.log_training(TrainingRecord(iteration, 6, 8 * iteration, ms, 1e-4, 8, 3.0, mfu=ms / 1000,
                                               memory_mb=1000.0 + iteration, memory_kind="cuda peak"))
            if iteration % 2 == 0:
                logger.log_evaluation("valid", iteration, 2.5)
        logger.log_evaluation("test", 6, 2.4)
    metrics = report.run_metrics(path, profiled=5)  # iteration 5 was profiled: left out
    assert metrics == {"ms": 110.0, "mfu": 0.11, "memory_mib": 1006.0, "memory_kind": "cuda peak"}


def test_the_fp8_step_is_summarised_by_its_lines(tmp_path):
    """bench_fp8.py's --json rows (one line each: FP8 against bf16 and the targets) make the step's row."""
    (tmp_path / "steps.tsv").write_text("bench-fp8\tok\t120\t150\n")
    rows = [{"model": "8b-layers", "line": "8b-layers: FP8 1 tokens/s ... NOT met"},
            {"model": "1b", "line": "1b: not measured (FP8 run did not finish)"}]
    (tmp_path / "bench-fp8.json").write_text(json.dumps({"device": "NVIDIA H200", "rows": rows}))
    text = report.table(tmp_path, "bash gpu_check.sh", "NVIDIA H200", "h200")
    assert ("| bench-fp8 | ok | 120 (150) | 8b-layers: FP8 1 tokens/s ... NOT met; "
            "1b: not measured (FP8 run did not finish) |") in text
    (tmp_path / "bench-fp8.json").unlink()
    assert "| bench-fp8 | ok | 120 (150) | no result file |" in report.table(tmp_path, "c", "g", "h200")


def test_carried_wheels_are_unpacked_onto_the_path(tmp_path):
    """A pure-Python wheel in $GPU_CHECK_WHEELS (fla-core's, on a machine without an index) is
    unpacked and named on stderr (the steps' PYTHONPATH is not observed here); one that is no
    wheel stops the script in one line."""
    import zipfile
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    with zipfile.ZipFile(wheels / "carried_probe-1.0-py3-none-any.whl", "w") as whl:
        whl.writestr("carried_probe/__init__.py", "X = 7\n")
    done = run("--cpu-smoke", "--only", "tests", "--budget", "0", "--out", str(tmp_path / "t.md"),
               env={"GPU_CHECK_WHEELS": str(wheels)})
    assert done.returncode == 0, done.stderr
    assert "carried wheels on PYTHONPATH: carried_probe-1.0-py3-none-any.whl" in done.stderr
    (wheels / "broken-1.0-py3-none-any.whl").write_text("not a zip")
    done = run("--cpu-smoke", "--only", "tests", "--budget", "0", "--out", str(tmp_path / "t.md"),
               env={"GPU_CHECK_WHEELS": str(wheels)})
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        f"gpu_check.sh: cannot unpack the wheel {wheels / 'broken-1.0-py3-none-any.whl'}"]
