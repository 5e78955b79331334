"""The eager path's structure, which keeps megalite's host time per call small (timings are in
tools/benchmarks/bench_host_overhead.py and never asserted): after the first call, a kernel
launch skips JITFunction.run (no re-binding, re-specialising or cache-key building), no
operator is dispatched, and the SM count is asked of the device once, not per call."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megalite.kernels import triton_common

ROOT = Path(__file__).resolve().parents[2]


def test_eager_calls_launch_compiled_kernels_directly():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.host_path_check"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout)
    assert result["launcher"] == "DirectLauncher"
    # [JITFunction.run calls, kernel launches] per forward + backward: Triton's run() for the first
    # call of each kernel (compile), then only direct launches, three per call: the forward, the
    # backward, and the sum of its dweight partials (a kernel writing the weight's dtype: no torch
    # sum or cast on the host, for LayerNorm's dbias either).
    assert result["calls"] == [[3, 3]] + [[0, 3]] * 4, result["calls"]
    assert result["layer_norm_launches"] == [3, 3] and result["torch_reductions"] == [], result
    assert result["hook_runner_calls"] == [0, 1], result  # Triton's runner only for a profiler's launch hook
    assert result["misaligned_runs"] == 1 and result["specialisations"] == 2, result


def test_sm_count_is_asked_once_per_device(monkeypatch):
    asked = []

    def properties(device):
        asked.append(device)
        return type("Props", (), {"multi_processor_count": 132})()

    monkeypatch.setattr(torch.cuda, "get_device_properties", properties)
    triton_common._cached_sm_count.cache_clear()
    try:
        for _ in range(3):
            assert triton_common.cached_sm_count(torch.device("cuda", 0)) == 132
            assert triton_common.sm_count(torch.device("cuda", 0)) == 132
    finally:
        triton_common._cached_sm_count.cache_clear()
    assert len(asked) == 1 + 3  # the cached lookup once; the live one (operator path, dry runs) every time


@pytest.mark.slow
def test_host_overhead_benchmark_prints_its_table():
    """tools/benchmarks/bench_host_overhead.py runs without a GPU (launches stubbed) and prints one
    row per op; its numbers are reported, not asserted."""
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the benchmark would time real launches (run it by hand)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    proc = subprocess.run([sys.executable, str(ROOT / "tools" / "benchmarks" / "bench_host_overhead.py"), "--ops",
                           "rms_norm,swiglu"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[0].strip() for r in rows[1:]] == ["rms_norm", "swiglu"]
    # one launch forward; backward: the kernel, and for RMSNorm the sum of its dweight partials
    assert [(r[3].strip(), r[6].strip()) for r in rows[1:]] == [("1", "2"), ("1", "1")]
    assert "trivial Triton launch:" in proc.stdout


def test_host_overhead_rows_without_a_launch_counter():
    """On a real GPU launches are not counted (the counter gives None): the first H100 run crashed
    subtracting None from None. measure() must give None launches and markdown() print '-'."""
    sys.path.insert(0, str(ROOT / "tools" / "benchmarks"))
    try:
        import bench_host_overhead as bench
    finally:
        sys.path.remove(str(ROOT / "tools" / "benchmarks"))
    x = torch.randn(4, 8, requires_grad=True)
    row = bench.measure("double", [x], torch.ones(4, 8), lambda t: t * 2, calls=2, counter=lambda: None)
    assert row["fwd_launches"] is None and row["bwd_launches"] is None
    assert row["fwd_us"] > 0
    line = bench.markdown([dict(row, impl="megalite triton")], trivial=1.0, round_trip=1.0).splitlines()[-1]
    assert line.split("|")[4].strip() == "-" and line.split("|")[7].strip() == "-"
