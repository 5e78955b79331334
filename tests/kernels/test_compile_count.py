"""tests/kernels/compile_count.py, the count of the Triton compilations a CUDA run of the kernel
tests makes, on a made-up test file: launches sharing their specialisation count once, a width
whose rows are 16-element aligned is a new one, and the per-file summary."""

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.kernels.compile_count import summary

ROOT = Path(__file__).resolve().parents[2]

TESTS = """
import torch
from megalite.kernels import rms_norm

def _norm(h):
    x = torch.randn(3, h, requires_grad=True)
    rms_norm(x, torch.ones(h), impl="triton").sum().backward()

def test_same_tiles():  # widths 33 and 40: the same tiles, neither a multiple of 16
    _norm(33)
    _norm(40)

def test_aligned_rows():  # width 48: rows 16-element aligned, another specialisation
    _norm(48)
"""


def test_launches_sharing_a_specialisation_compile_once(tmp_path):
    (tmp_path / "test_made_up.py").write_text(TESTS)
    out = tmp_path / "count.json"
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p",
                           "tests.kernels.compile_count", "--compile-count", str(out), str(tmp_path / "test_made_up.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    per_test = json.loads(out.read_text())
    same, aligned = per_test["test_made_up.py::test_same_tiles"], per_test["test_made_up.py::test_aligned_rows"]
    # one forward, one backward, one sum of the dweight partials
    assert [k.split()[0] for k in same] == ["_column_sums_kernel", "_norm_bwd_kernel", "_norm_fwd_kernel"]
    assert len(aligned) == 3 and not set(aligned) & set(same)
    assert summary(per_test) == {"distinct": 6, "files": {"test_made_up.py": (2, 6, 6)}}


def test_summary_counts_what_each_file_alone_needs():
    per_test = {"a.py::t1": ["k1", "k2"], "a.py::t2": ["k2"], "b.py::t": ["k2", "k3"]}
    assert summary(per_test) == {"distinct": 3, "files": {"a.py": (2, 1, 2), "b.py": (1, 1, 2)}}
