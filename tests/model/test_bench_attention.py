"""tools/benchmarks/bench_attention.py end to end on the CPU (--cpu-smoke: tiny shapes, the CPU's
kernels), its measured order, and the rewrite of attention_kernels.MEASURED it records."""

import ast
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

from megalite.model import attention_kernels
from megalite.model.attention_kernels import CUDNN, EFFICIENT, FLASH, MATH, kernel_order, rewrite_table
from tests.model.test_attention_kernels import DRIVER, H200, MLA

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "benchmarks" / "bench_attention.py"


def load_script():
    spec = importlib.util.spec_from_file_location("bench_attention", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_cpu_smoke_checks_and_times_each_kernel():
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--cpu-smoke"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines()
            if line.startswith("| ") and not line.startswith("| shape")]
    assert {(r[0], r[1]) for r in rows} == {(s, k) for s in ("driver", "mla")
                                            for k in ("MATH", "FLASH_ATTENTION", "megalite auto")}
    assert all(r[-1] == "ok" and float(r[2]) > 0 and float(r[3]) > 0 for r in rows), rows


def test_without_gpu_says_so_and_exits_0(monkeypatch, capsys):
    bench = load_script()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 0
    assert "no CUDA GPU here, nothing to measure" in capsys.readouterr().out


def test_unknown_shape_is_one_line(monkeypatch, capsys):
    bench = load_script()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert bench.main(["--shapes", "driver,llama9"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bench_attention: --shapes: unknown llama9 (known: driver,gpt2,mla,driver-dropout)"]


def test_a_wrong_kernel_fails_its_check():
    bench = load_script()
    shape = bench.SMOKE_SHAPES["driver"]
    qkv, grad = bench.inputs(shape, torch.device("cpu"), torch.float32)
    wrong = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731 (not causal)
        q, k, v, enable_gqa=True, scale=shape.d_qk ** -0.5)
    assert bench.check(wrong, shape, qkv, grad, bench.math_reference(shape, qkv, grad)).startswith("relative error")


def test_measured_order_is_fastest_first_per_head_widths_and_leaves_dropout_out():
    bench = load_script()
    shapes = [bench.SHAPES[name] for name in ("driver", "mla", "driver-dropout")]
    passed = {"driver": {"FLASH_ATTENTION": (1.0, 2.0), "CUDNN_ATTENTION": (0.5, 1.0), "EFFICIENT_ATTENTION": (2.0, 4.0),
                         "megalite auto": (0.1, 0.1), "flash_attn package": (0.1, 0.1)},
              "mla": {"EFFICIENT_ATTENTION": (2.0, 4.0), "CUDNN_ATTENTION": (3.0, 4.0)},
              "driver-dropout": {"FLASH_ATTENTION": (0.1, 0.1)}}
    assert bench.measured_order(shapes, passed) == {
        "qk128-v128": ("CUDNN_ATTENTION", "FLASH_ATTENTION", "EFFICIENT_ATTENTION"),
        "qk192-v128": ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")}


def test_rewrite_table_keeps_other_cards_and_kernel_order_reads_it(tmp_path):
    path = tmp_path / "attention_kernels.py"
    shutil.copy(attention_kernels.__file__, path)
    rewrite_table(str(path), "NVIDIA A100-SXM4-80GB", {"qk128-v128": ("FLASH_ATTENTION",)})
    rewrite_table(str(path), "NVIDIA H200", {"qk128-v128": ("FLASH_ATTENTION", "CUDNN_ATTENTION"),
                                             "qk192-v128": ("EFFICIENT_ATTENTION",)})
    rewrite_table(str(path), "NVIDIA H200", {"qk128-v128": ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")})
    source = path.read_text()
    start = source.index("MEASURED: ")
    table = ast.literal_eval(source[start:source.index("# (end of the measured table)")].split("=", 1)[1].strip())
    assert table == {"NVIDIA A100-SXM4-80GB": {"qk128-v128": ("FLASH_ATTENTION",)},
                     "NVIDIA H200": {"qk128-v128": ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")}}
    assert kernel_order("auto", H200, DRIVER, table) == (EFFICIENT, CUDNN, FLASH, MATH)
    assert kernel_order("auto", H200, MLA, table) == (CUDNN, FLASH, EFFICIENT, MATH)  # its row replaced whole
    compile(source, str(path), "exec")  # still Python
