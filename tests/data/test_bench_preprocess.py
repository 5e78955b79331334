"""bench_data_preprocess.py --compare: megalite against gigatoken alone, at toy scale."""

import importlib.util
import os
import re

import pytest

from tests.data.conftest import REPO


def bench_module():
    path = os.path.join(REPO, "tools", "benchmarks", "bench_data_preprocess.py")
    spec = importlib.util.spec_from_file_location("bench_data_preprocess", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_repeated_corpus_writes_the_demo_whole_until_the_size(tmp_path):
    demo = tmp_path / "demo.jsonl"
    demo.write_bytes(b'{"text": "a"}\n{"text": "bc"}\n' * 20_000)  # 620 KB
    size = os.path.getsize(demo)
    repeats = bench_module().repeated_corpus(str(demo), str(tmp_path / "big.jsonl"), 2.5 * size / 1e6)
    assert repeats == 3
    assert (tmp_path / "big.jsonl").read_bytes() == demo.read_bytes() * 3


def test_compare_alternates_the_order_and_checks_the_outputs(tmp_path, capsys):
    pytest.importorskip("gigatoken")
    runs = bench_module().compare_with_gigatoken(str(tmp_path), 0.3, 2, 300)
    out = capsys.readouterr().out
    assert [run[0] for run in runs] == ["megalite-2", "gigatoken-files", "gigatoken-files", "megalite-2"]
    assert all(seconds > 0 and busiest > 0 for _, _, seconds, _, busiest in runs)
    assert len(re.findall(r"^round [12] (megalite-2|gigatoken-files) +load .* MB/s", out, re.M)) == 4, out
    assert re.search(r"^best of 2: megalite [\d.]+ MB/s, gigatoken [\d.]+ MB/s; megalite takes [\d.]+x gigatoken's "
                     r"wall time \([\d.]+x its busiest-process CPU time\); outputs identical$", out, re.M), out
