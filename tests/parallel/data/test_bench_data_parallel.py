"""tools/benchmarks/bench_data_parallel.py end to end on a tiny model (one spawn of 4 gloo
processes, 2 timing rounds): both tables carry the expected rows, every printed time and ratio
is the one computed from the measured numbers the --json file holds, and the memory rows match
formulas.md (CPU offload: device and host apart, no formula)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "benchmarks" / "bench_data_parallel.py"
SMOKE = ["--layers", "1", "--hidden", "64", "--vocab", "256", "--seq", "16", "--rounds", "2", "--bucket-size", "10000"]
RUNNERS = ["megalite DDP, overlap off", "megalite DDP, overlap on", "torch DDP (peer)", "no communication (DP=1 each)"]
# setup label -> (formula B/param or None, expected optimizer B/param, host B/param)
MEMORY_ROWS = {"d=1 distributed optimizer": (18.0, 12.0, 0.0), "d=2 distributed optimizer": (12.0, 6.0, 0.0),
               "d=4 distributed optimizer": (9.0, 3.0, 0.0), "d=2 plain optimizer": (18.0, 12.0, 0.0),
               "d=2 distributed optimizer + CPU offload": (None, 8.0, 8.0)}


def _rows(stdout: str, names) -> dict:
    """{name: the whitespace-separated cells after it} for the lines starting with a name."""
    rows = {}
    for line in stdout.splitlines():
        for name in names:
            rest = line[len(name):]
            if line.startswith(name) and rest[:1] == " " and not rest.lstrip().startswith("+"):
                rows[name] = rest.split()
    return rows


@pytest.mark.slow
def test_smoke_run_prints_both_tables_from_the_measured_numbers(tmp_path):
    out = tmp_path / "bench.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(SCRIPT), *SMOKE, "--json", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    measured = json.loads(out.read_text())
    best, median = measured["timing"]["best_s"], measured["timing"]["median_s"]
    assert list(best) == RUNNERS and all(t > 0 for t in best.values()), best

    timing = _rows(proc.stdout, RUNNERS)
    assert list(timing) == RUNNERS, proc.stdout
    floor, peer = best["no communication (DP=1 each)"], best["torch DDP (peer)"]
    for name, cells in timing.items():
        assert cells == [f"{1000 * best[name]:.1f}", f"{1000 * median[name]:.1f}", f"{best[name] / peer:.3f}",
                         f"{1000 * (best[name] - floor):.1f}", "ms"], (name, cells)
    saved = best["megalite DDP, overlap off"] - best["megalite DDP, overlap on"]
    assert f"overlap_grad_reduce saves {1000 * saved:.1f} ms per step" in proc.stdout

    memory = _rows(proc.stdout, sorted(MEMORY_ROWS, key=len, reverse=True))
    assert set(memory) == set(MEMORY_ROWS), proc.stdout
    by_label = dict(zip(MEMORY_ROWS, measured["memory"]))
    for label, (formula, optimizer, host) in MEMORY_ROWS.items():
        info, cells = by_label[label], memory[label]
        assert (info["dp"], info["distributed_optimizer"], info["cpu_offload"]) == \
            (int(label[2]), "distributed" in label, "offload" in label), label
        assert info["formula_bytes_per_param"] == formula, label
        # params, weights, grads, optimizer MiB, device and host B/param, formula, ratio, optim B/param, expected
        assert cells[4:6] == [f"{info['device_bytes_per_param']:.4f}", f"{info['host_bytes_per_param']:.4f}"], label
        if formula is None:
            assert cells[6:8] == ["n/a", "n/a"], label
        else:
            assert cells[6:8] == [f"{formula:.3f}", f"{info['bytes_per_param'] / formula:.4f}"], label
            assert abs(info["bytes_per_param"] / formula - 1) < 0.01, label
        assert cells[8:] == [f"{info['optimizer_bytes_per_param']:.4f}", f"{optimizer:.2f}"], label
        assert abs(info["optimizer_bytes_per_param"] / optimizer - 1) < 0.01, label
        assert abs(info["host_bytes_per_param"] - host) <= 0.01 * optimizer, label
