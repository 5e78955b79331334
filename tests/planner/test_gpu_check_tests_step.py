"""gpu_check.sh's tests step and host-overhead row, without a GPU: a pytest run killed at its
budget still names every failure and the tests it was running (tools/benchmarks/pytest_stream.py,
read by gpu_check_report.py), and the host-overhead row prints the times a GPU run measures."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCHMARKS = REPO / "tools/benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_check_report as report  # noqa: E402
from pytest_stream import read_results  # noqa: E402

TESTS = """
import time
import pytest

@pytest.fixture
def broken():
    raise RuntimeError("setup broke")

def test_pass():
    pass

def test_fail():
    assert 1 == 2, "one is not two"

def test_error_in_setup(broken):
    pass

@pytest.mark.skip(reason="not here")
def test_skipped():
    pass

def test_hang():
    time.sleep(600)
"""


def _pytest(tmp_path, results, *extra):
    env = dict(os.environ, PYTHONPATH=str(BENCHMARKS), PYTHONUNBUFFERED="1")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "pytest_stream",
               "--stream-results", str(results), *extra, str(tmp_path / "test_x.py")]
    return subprocess.Popen(command, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)


def test_a_killed_run_names_every_failure_and_what_it_was_running(tmp_path):
    """Killed (SIGKILL, as `timeout --kill-after` ends it) while a test hangs: no --junitxml, no
    flush of its output; the stream file written as the tests finished still holds every outcome."""
    (tmp_path / "test_x.py").write_text(TESTS)
    results = tmp_path / "tests-kernels.results"
    proc = _pytest(tmp_path, results)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and "started test_x.py::test_hang" not in (
                results.read_text() if results.exists() else ""):
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.2)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    found = read_results(results)
    assert found["running"] == ["test_x.py::test_hang"]
    assert found["outcomes"] == {"test_x.py::test_pass": "passed", "test_x.py::test_fail": "failed",
                                 "test_x.py::test_error_in_setup": "error", "test_x.py::test_skipped": "skipped"}
    assert "one is not two" in found["reasons"]["test_x.py::test_fail"]
    assert report.junit_summary(tmp_path / "tests-kernels.xml") == (
        "killed before the end: 1 passed, 2 failed, 1 skipped: test_x.py::test_fail, test_x.py::test_error_in_setup; "
        "running when killed: test_x.py::test_hang")


def test_under_xdist_the_controller_alone_writes(tmp_path):
    """Each test started and finished once in the file, whichever worker ran it."""
    pytest.importorskip("xdist")
    (tmp_path / "test_x.py").write_text(TESTS.replace("time.sleep(600)", "pass"))
    results = tmp_path / "out.results"
    proc = _pytest(tmp_path, results, "-n", "2")
    assert proc.wait(timeout=300) == 1, proc.stderr.read()[-2000:]  # pytest's exit status for failures
    lines = results.read_text().splitlines()
    assert sorted(line.split(" | ")[0] for line in lines) == sorted(
        [f"started test_x.py::{t}" for t in ("test_pass", "test_fail", "test_error_in_setup", "test_skipped",
                                             "test_hang")]
        + ["passed test_x.py::test_pass", "failed test_x.py::test_fail", "error test_x.py::test_error_in_setup",
           "skipped test_x.py::test_skipped", "passed test_x.py::test_hang"])


def test_the_host_overhead_row_prints_a_gpu_runs_times(tmp_path):
    """On a GPU bench_host_overhead counts no launches and prints '-' in its added columns; the row
    printed '+- us fwd, +- us bwd' for every op. It now gives each implementation's times per call,
    and the time added over the launches where they were counted (no GPU)."""
    header = ("| op | impl | fwd us | launches | fwd added us | bwd us | launches | bwd added us |\n"
              "|---|---|---:|---:|---:|---:|---:|---:|\n")
    (tmp_path / "gpu.log").write_text(header + "| rms_norm | megalite triton | 21.5 | - | - | 227.8 | - | - |\n"
                                      "| rms_norm | torch op | 19.0 | - | - | 117.2 | - | - |\n"
                                      "| swiglu | megalite triton | 15.1 | - | - | 40.2 | - | - |\n")
    assert report.host_summary(tmp_path / "gpu.log") == (
        "us per call, forward/backward: rms_norm: megalite triton 21.5/227.8 us, torch op 19.0/117.2 us; "
        "swiglu: megalite triton 15.1/40.2 us")
    (tmp_path / "cpu.log").write_text(header + "| rms_norm | megalite triton | 12.0 | 1 | 9.5 | 30.0 | 1 | -1.5 |\n")
    assert report.host_summary(tmp_path / "cpu.log") == (
        "us per call, forward/backward: rms_norm: megalite triton 12.0/30.0 us (+9.5/-1.5 over its launches)")
