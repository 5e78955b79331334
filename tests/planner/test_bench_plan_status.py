"""tools/benchmarks/bench_plan.py exits 0 when it measured every layout, whether its targets were
met or not (a "targets met/missed" line says which), and 1 when a run failed; the calibration,
prediction and real runs are stood in for here (the real ones take minutes: run:doc-bench-plan)."""

import dataclasses
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools/benchmarks"))
import bench_plan  # noqa: E402


@dataclasses.dataclass
class _Cluster:
    peak_flops: float = 1e9
    slowdown: dict = dataclasses.field(default_factory=dict)
    memory_bandwidth: float = 1e9
    op_overhead: float = 0.0
    source: str = "stand-in"


def _stand_in(monkeypatch, measured):
    """Predictions of 1, 2, 3, 4 s; `measured(prediction)` the measurement of each."""
    predictions = iter([1.0, 2.0, 3.0, 4.0])
    monkeypatch.setattr(bench_plan, "calibrate", lambda world: _Cluster())
    monkeypatch.setattr(bench_plan, "peak_memory", lambda workload, layout: None)
    monkeypatch.setattr(bench_plan, "predict", lambda cluster, workload, layout, memory: SimpleNamespace(
        step_time=next(predictions), breakdown={}))
    monkeypatch.setattr(bench_plan, "Plan", lambda *args: None)
    monkeypatch.setattr(bench_plan, "command", lambda plan, prediction: str(prediction.step_time))
    monkeypatch.setattr(bench_plan, "measure", lambda cmd, *args: (measured(float(cmd)), [measured(float(cmd))]))


@pytest.mark.parametrize("measured, verdict", [
    (lambda p: p * 1.1, "targets met: Spearman 1.00 >= 0.8: met; largest error 9% <= 25%: met"),
    (lambda p: 10.0 / p, "targets missed: Spearman -1.00 >= 0.8: MISSED; largest error 90% <= 25%: MISSED"),
])
def test_a_missed_target_is_a_line_not_a_failure(monkeypatch, capsys, tmp_path, measured, verdict):
    _stand_in(monkeypatch, measured)
    assert bench_plan.main(["--world-sizes", "4", "--json", str(tmp_path / "out.json")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == verdict
    assert (tmp_path / "out.json").exists()


def test_a_failed_run_exits_1(monkeypatch, capsys):
    _stand_in(monkeypatch, lambda p: p)

    def broken(*args):
        raise RuntimeError("cmd: 0 of 10 iterations logged; the run's output ends:\nTraceback")
    monkeypatch.setattr(bench_plan, "measure", broken)
    assert bench_plan.main(["--world-sizes", "4"]) == 1
    assert "bench_plan: cmd: 0 of 10 iterations logged" in capsys.readouterr().err
