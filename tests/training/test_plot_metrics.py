"""tools/plot_metrics.py: a PNG from a metrics file; bad lines are named by file and line."""

import importlib.util
import json
import os

import pytest

TOOL = os.path.join(os.path.dirname(__file__), "..", "..", "tools", "plot_metrics.py")


@pytest.fixture(scope="module")
def plot_metrics():
    spec = importlib.util.spec_from_file_location("plot_metrics_tool", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_metrics(path, lines):
    path.write_text("".join(line if isinstance(line, str) else json.dumps(line) + "\n"
                            for line in lines))


def test_draws_a_png(tmp_path, plot_metrics, capsys):
    pytest.importorskip("matplotlib")
    metrics = tmp_path / "metrics.jsonl"
    records = [{"iteration": i, "lm_loss": 5.0 / i, "learning_rate": 1e-3 * min(1, i / 3),
                "tokens_per_second_per_gpu": 1000.0 + i, "tflops_per_gpu": None} for i in range(1, 9)]
    records += [{"split": "valid", "iteration": 4, "lm_loss": 1.4},
                {"split": "valid", "iteration": 8, "lm_loss": 0.9},
                {"iteration": 8, "lm_loss": 0.5, "learning_rate": 1e-3},   # a resumed run's repeat
                {"split": "test", "iteration": 8, "lm_loss": 1.0}]
    write_metrics(metrics, records + ["\n"])
    train, evals = plot_metrics.read_metrics(str(metrics))
    assert train[8]["lm_loss"] == 0.5 and sorted(evals) == ["test", "valid"]
    output = tmp_path / "plots" / "loss.png"
    assert plot_metrics.main([str(metrics), "--output", str(output)]) == 0
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and output.stat().st_size > 10_000
    assert os.listdir(output.parent) == ["loss.png"]          # no temporary left behind
    assert str(output) in capsys.readouterr().out


@pytest.mark.parametrize("bad_line, words", [
    ('{"iteration": 3, "lm_loss": \n', ["metrics.jsonl:2", "not valid JSON"]),
    ('{"lm_loss": 1.0}\n', ["metrics.jsonl:2", "iteration"]),
    ('[1, 2]\n', ["metrics.jsonl:2", "JSON object"]),
])
def test_bad_lines_are_named(tmp_path, plot_metrics, capsys, bad_line, words):
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics, [{"iteration": 1, "lm_loss": 2.0}, bad_line])
    output = tmp_path / "loss.png"
    assert plot_metrics.main([str(metrics), "--output", str(output)]) == 1
    error = capsys.readouterr().err
    assert all(word in error for word in words), error
    assert not output.exists()


def test_missing_and_empty_files(tmp_path, plot_metrics, capsys):
    assert plot_metrics.main([str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "x.png")]) == 1
    assert "none.jsonl" in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert plot_metrics.main([str(empty), "--output", str(tmp_path / "x.png")]) == 1
    assert "no records" in capsys.readouterr().err


def test_missing_matplotlib_is_a_clear_error(tmp_path, plot_metrics, capsys, monkeypatch):
    metrics = tmp_path / "metrics.jsonl"
    write_metrics(metrics, [{"iteration": 1, "lm_loss": 2.0}])
    monkeypatch.setitem(__import__("sys").modules, "matplotlib", None)   # import now fails
    assert plot_metrics.main([str(metrics), "--output", str(tmp_path / "x.png")]) == 1
    assert "matplotlib is not installed" in capsys.readouterr().err
