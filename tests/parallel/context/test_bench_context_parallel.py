"""tools/benchmarks/bench_context_parallel.py runs end to end on a short sequence (slow: three
spawns)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_bench_smoke_run():
    out = subprocess.run([sys.executable, str(REPO / "tools" / "benchmarks" / "bench_context_parallel.py"),
                          "--seq", "64", "--rounds", "1", "--memory-seq", "64"],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert out.returncode == 0, out.stderr[-3000:]
    for row in ("| CP=1 |", "| CP=2 p2p (ring, overlapped) |", "| CP=2 p2p (ring, transfer waited) |",
                "| CP=2 all_gather |", "| CP=2 a2a |", "| p2p |", "| all_gather |", "| a2a |"):
        assert row in out.stdout, out.stdout
