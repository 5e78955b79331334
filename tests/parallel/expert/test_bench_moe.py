"""tools/benchmarks/bench_moe.py runs (a smoke size) and its all-to-all bytes, counted inside
the all-to-all, agree with the balanced-load formula (exactly 0 at EP = 1)."""

import argparse
from pathlib import Path

import pytest


@pytest.mark.slow
def test_bench_moe_smoke(capsys, monkeypatch):
    # Importable by name, so that the spawned ranks can unpickle its worker (spawn passes sys.path).
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3] / "tools" / "benchmarks"))
    import bench_moe as bench
    argv = ["--layers", "1", "--hidden", "32", "--ffn", "32", "--seq", "16", "--steps", "2"]
    results = bench.main(argv)
    options = argparse.Namespace(layers=1, hidden=32, micro=2, seq=16, micro_batches=2)
    for i, row in enumerate(results[0]):
        measured = sum(r[i]["bytes"] for r in results) / len(results)
        if row["dispatcher"] != "alltoall":
            continue
        formula = bench.formula_bytes(options, row["ep"])
        assert (measured == formula == 0) if row["ep"] == 1 else 0.7 < measured / formula < 1.3
    assert "| 4 | alltoall |" in capsys.readouterr().out
