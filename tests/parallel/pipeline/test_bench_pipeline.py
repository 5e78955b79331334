"""tools/benchmarks/bench_pipeline.py end to end at a tiny size: every runner is timed every
round, and the JSON's figures and verdicts follow from the step times it measured."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
SCRIPT = ROOT / "tools" / "benchmarks" / "bench_pipeline.py"
RUNNERS = {"ideal", "megalite gpipe", "megalite 1f1b", "megalite interleaved v=2", "megalite zb_h1",
           "torch Schedule1F1B", "torch ScheduleInterleaved1F1B v=2"}


def test_tiny_run_reports_every_runner_and_derived_targets(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--microbatches", "2", "--hidden", "16", "--seq", "4",
                           "--rounds", "3", "--json", str(out)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())["results"]["2"]
    assert set(result["best_s"]) == RUNNERS and all(t > 0 for t in result["best_s"].values())
    best = result["best_s"]
    assert result["interleaved_vs_torch"] == best["megalite interleaved v=2"] / best[
        "torch ScheduleInterleaved1F1B v=2"]
    assert result["interleaved_saving_of_ideal"] == (
        best["megalite 1f1b"] - best["megalite interleaved v=2"]) / best["ideal"]
    assert result["formula_saving_of_ideal"] == 1 / 2 - 1 / 4  # (p-1)/m - (p-1)/(v m), p=2, m=2, v=2
    for name, median in result["median_s"].items():
        assert best[name] <= median, name
    # the verdicts printed are those of the per-round (paired) figures
    met_torch = result["interleaved_vs_torch_paired"] <= 1.0
    met_bubble = result["paired_saving_of_ideal"] >= 0.5 * result["formula_saving_of_ideal"]
    verdicts = [line for line in proc.stdout.splitlines() if "target" in line]
    assert len(verdicts) == 2, proc.stdout
    assert ("target <= 1: met" in verdicts[0]) == met_torch, verdicts[0]
    assert (": met" in verdicts[1]) == met_bubble, verdicts[1]
