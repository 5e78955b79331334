"""The kernel benchmark runs end to end (CPU smoke mode: tiny shapes, torch paths only)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "benchmarks" / "bench_kernels.py"


def _run(*args):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)


def test_cpu_smoke_prints_a_table():
    proc = _run("--cpu-smoke", "--ops", "rms_norm,layer_norm,cross_entropy")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    assert any(line.startswith("measured copy bandwidth:") for line in lines)
    table = [line for line in lines if line.startswith("| ") and "---" not in line]
    impls = {tuple(cell.strip() for cell in line.split("|")[1:4]) for line in table[1:]}
    assert ("rms_norm", "[64, 256]", "torch reference") in impls
    assert ("cross_entropy", "[64, 1000]", "F.cross_entropy(fp32 logits)") in impls
    assert not any("triton" == impl for _, _, impl in impls), "CPU smoke run must not time Triton"


# The script started the way a fresh GPU machine starts it: from another directory, with megalite
# neither installed (the editable-install finder is dropped) nor on PYTHONPATH.
WITHOUT_INSTALL = """
import importlib.util, runpy, sys
sys.meta_path[:] = [f for f in sys.meta_path if "__editable__" not in getattr(f, "__module__", "")]
sys.path[:] = [p for p in sys.path if p not in ("", ".")]
assert importlib.util.find_spec("megalite") is None, "megalite is still importable"
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_runs_without_pip_install(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    proc = subprocess.run([sys.executable, "-c", WITHOUT_INSTALL, str(SCRIPT), "--cpu-smoke", "--ops", "rms_norm"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "| rms_norm | [64, 256] | torch reference |" in proc.stdout


def test_without_gpu_says_so_and_exits_0():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run the full benchmark")
    proc = _run()
    assert proc.returncode == 0 and "no CUDA device" in proc.stdout, proc.stderr[-3000:]


def test_unknown_op_is_rejected():
    proc = _run("--cpu-smoke", "--ops", "rms_norm,fused_attention")
    assert proc.returncode == 2 and "--ops: unknown ['fused_attention']" in proc.stderr
