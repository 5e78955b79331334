"""tools/benchmarks/bench_context_parallel.py runs end to end on a short sequence (slow: three
spawns)."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[3] / "tools" / "benchmarks" / "bench_context_parallel.py"


@pytest.mark.slow
def test_bench_smoke_run(capsys):
    spec = importlib.util.spec_from_file_location("bench_context_parallel", BENCH)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    bench.main(["--seq", "64", "--rounds", "1", "--memory-seq", "64"])
    out = capsys.readouterr().out
    for row in ("| CP=1 |", "| CP=2 p2p (ring, overlapped) |", "| CP=2 p2p (ring, transfer waited) |",
                "| CP=2 all_gather |", "| CP=2 a2a |", "| p2p |", "| a2a |"):
        assert row in out, out
