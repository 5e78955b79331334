"""tools/benchmarks/bench_model.py end to end on the CPU: --cpu-smoke runs tiny configs of both
families through the rows (aot_eager compile) and the kernel benchmark's smoke mode, and prints
one report; the default run takes the rows that need no Triton (kernels off eager and compiled,
the compiled transformers peer), one kernel-benchmark op and a simulated out-of-memory that
halves one model's micro-batch; the slow test runs every row, the Triton-kernel rows in
Triton's interpreter, and every kernel-benchmark op."""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "benchmarks" / "bench_model.py"
SMOKE_VOCAB = 500
MEGALITE_ROWS = {"no-kernels": "megalite, torch reference ops (fused_kernels=False)",
                 "no-kernels-compile": "megalite, torch reference ops + --torch-compile",
                 "kernels": "megalite, Triton kernels",
                 "kernels-compile": "megalite, Triton kernels + --torch-compile"}
PEERS = {"gpt2-tiny": "transformers GPT2LMHeadModel, sdpa + torch.compile (peer)",
         "llama-tiny": "transformers LlamaForCausalLM, sdpa + torch.compile (peer)"}


def _run(*args, timeout=600):
    # The script sets TRITON_INTERPRET itself for --cpu-smoke; do not hand it the tests' setting.
    # It finds the repository itself (and hands it to the kernel benchmark): no PYTHONPATH.
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "PYTHONPATH")}
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _table(stdout: str) -> list[dict]:
    lines = [line for line in stdout.splitlines() if line.startswith("| ") and "---" not in line]
    header = [cell.strip() for cell in lines[0].strip("|").split("|")]
    return [dict(zip(header, (cell.strip() for cell in line.strip("|").split("|")))) for line in lines[1:]]


def _check_rows(rows, row_keys, batch_of):
    expected = {(model, MEGALITE_ROWS[key]) for model in PEERS for key in row_keys} | set(PEERS.items())
    assert {(r["model"], r["implementation"]) for r in rows} == expected
    assert len(rows) == len(expected)
    for r in rows:
        what = f"{r['model']} / {r['implementation']}"
        assert r["batch x seq"] == f"{batch_of[r['model']]} x 32", what
        assert r["MFU"] == "n/a", what
        assert float(r["tokens/s"].replace(",", "")) > 0 and float(r["TFLOP/s"]) >= 0, what
        first, last = (float(x) for x in r["loss first -> last"].split("->"))
        assert abs(first - math.log(SMOKE_VOCAB)) < 0.05, f"{what}: initial loss {first} is not ~ln(V)"
        assert last < first, f"{what}: the optimizer steps did not lower the loss on a fixed batch"
        if r["implementation"] in PEERS.values():
            assert r["vs peer (tokens/s)"] == "1.00x", what
        else:
            assert r["vs peer (tokens/s)"].endswith("x"), what
    for model in PEERS:  # megalite rows share weights and data: the same initial loss
        firsts = {r["loss first -> last"].split("->")[0] for r in rows
                  if r["model"] == model and r["implementation"] != PEERS[model]}
        assert len(firsts) == 1, f"{model}: megalite rows disagree on the initial loss {firsts}"


@pytest.mark.slow
def test_cpu_smoke_rows_without_triton(tmp_path):
    report = tmp_path / "report.md"
    keys = ["no-kernels", "no-kernels-compile"]
    proc = _run("--cpu-smoke", "--rows", ",".join(keys + ["peer"]), "--micro-batch-size", "gpt2-tiny=4",
                "--simulate-oom-above", "2", "--kernel-ops", "rms_norm", "--output", str(report))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "SMOKE RUN on the CPU" in proc.stdout
    assert "- command: `python" in proc.stdout and "--cpu-smoke" in proc.stdout
    assert "compile: backend aot_eager" in proc.stdout
    assert "Targets (smoke run: the verdicts mean nothing):" in proc.stdout
    for model in PEERS:
        assert f"- {model}: MFU >= " in proc.stdout and ": n/a (no peak FLOP/s for this device)" in proc.stdout
        assert f"- {model}: tokens/s >= 1.2x peer: best megalite row" in proc.stdout
    assert "[gpt2-tiny] out of memory at micro-batch 4" in proc.stderr
    assert "- gpt2-tiny / peer: out of memory at micro-batch 4; measured at 2" in proc.stdout
    assert "- llama-tiny wall time per row (build, compile, warm-up, timed steps): peer " in proc.stdout
    models, kernels = proc.stdout.split("# megalite kernel benchmark")
    _check_rows(_table(models), keys, {"gpt2-tiny": 2, "llama-tiny": 2})
    assert "measured copy bandwidth" in kernels and "bench_kernels.py --ops rms_norm --cpu-smoke" in kernels
    assert [(r["op"], r["shape"], r["impl"]) for r in _table(kernels)] == [
        ("rms_norm", "[64, 256]", "torch reference"), ("rms_norm", "[64, 256]", "F.rms_norm (bf16)")]
    assert report.read_text().strip() in proc.stdout and "| llama-tiny |" in report.read_text()


@pytest.mark.slow
def test_cpu_smoke_every_row_and_kernel_benchmark():
    proc = _run("--cpu-smoke")
    assert proc.returncode == 0, proc.stderr[-4000:]
    models, kernels = proc.stdout.split("# megalite kernel benchmark")
    _check_rows(_table(models), list(MEGALITE_ROWS), {"gpt2-tiny": 2, "llama-tiny": 2})
    ops = {r["op"] for r in _table(kernels)}
    assert ops == {"rms_norm", "layer_norm", "swiglu", "bias_gelu (tanh)", "apply_rotary", "cross_entropy"}


def test_without_gpu_says_so_and_exits_0():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the script would run the full benchmark")
    proc = _run()
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert proc.stdout.startswith("bench_model: no CUDA device, nothing to time"), proc.stdout


def _load_script():
    spec = importlib.util.spec_from_file_location("bench_model", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("args, message", [
    (["--models", "gpt2-124m,gpt3"], "--models: unknown ['gpt3']"),
    (["--rows", "kernels,fast"], "--rows: unknown ['fast']"),
    (["--micro-batch-size", "llama-1.3b=0"], "--micro-batch-size 'llama-1.3b=0': expected MODEL=B"),
    (["--micro-batch-size", "gpt2-tiny=2"], "--micro-batch-size 'gpt2-tiny=2': expected MODEL=B"),
    (["--steps", "0"], "--steps must be at least 1, got 0"),
    (["--kernel-ops", "rms_norm,flash"], "--kernel-ops: unknown ['flash']"),
    (["--time-limit", "0"], "--time-limit must be positive, got 0"),
])
def test_bad_flags_are_refused(args, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _load_script().parse_args(args)
    assert exit_info.value.code == 2 and message in capsys.readouterr().err


def test_report_pieces_a_gpu_run_would_print():
    """The GPU-only branches of the report (MFU, peak memory, verdicts, a failed row), fed with
    made-up results, and the out-of-memory retry down to micro-batch 1."""
    bench = _load_script()
    gpt2, llama = bench.model_specs(smoke=False)
    rows = {r.key: r for r in bench.ROWS}
    results = {
        "gpt2-124m": [bench.Result(rows["kernels"], 32, 0.05, 655360.0, 560.1, 0.566, 10.9, 10.7, 30.2, 124_000_000),
                      bench.Result(rows["no-kernels"], 32, error="RuntimeError: boom"),
                      bench.Result(rows["peer"], 32, 0.06, 500000.0, 427.3, 0.43, 10.9, 10.8, 40.0, 124_000_000)],
        "llama-1.3b": [bench.Result(rows["kernels-compile"], 8, 0.4, 40960.0, 368.6, 0.3726, 10.4, 10.3, 60.0, 1),
                       bench.Result(rows["peer"], 8, 0.5, 32768.0, 294.9, None, 10.4, 10.3, 61.0, 1)]}
    text = bench.table([gpt2, llama], results)
    assert "| gpt2-124m | megalite, Triton kernels | 32 x 1024 | 50.0 | 655,360 | 560.10 | 56.6% | 1.31x | " \
           "10.900 -> 10.700 | 30.2 |" in text
    assert "| gpt2-124m | megalite, torch reference ops (fused_kernels=False) | 32 x 1024 | failed: RuntimeError: " \
           "boom |" in text
    assert "| llama-1.3b | transformers LlamaForCausalLM, sdpa + torch.compile (peer) | 8 x 2048 | 500.0 |" in text
    assert all(line.count("|") == 11 for line in text.splitlines())
    verdicts = bench.targets([gpt2, llama], results)
    assert verdicts == [
        '- gpt2-124m: MFU >= 45%: best megalite row "megalite, Triton kernels" 56.6% -> pass',
        '- gpt2-124m: tokens/s >= 1.2x peer: best megalite row "megalite, Triton kernels" 1.31x -> pass',
        '- llama-1.3b: MFU >= 55%: best megalite row "megalite, Triton kernels + --torch-compile" 37.3% -> MISS',
        '- llama-1.3b: tokens/s >= 1.2x peer: best megalite row "megalite, Triton kernels + --torch-compile" '
        '1.25x -> pass']
    assert bench.targets([gpt2], {"gpt2-124m": results["gpt2-124m"][1:]}) == [
        "- gpt2-124m: no megalite row ran: targets not evaluated"]

    wrapped = RuntimeError("compilation failed")
    wrapped.__cause__ = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    assert bench._is_oom(wrapped) and not bench._is_oom(RuntimeError("shape mismatch"))
    args = bench.parse_args(["--cpu-smoke", "--simulate-oom-above", "0", "--micro-batch-size", "gpt2-tiny=4"])
    failed = bench.run_model(args.specs[0], args.row_list, torch.device("cpu"), None, args)
    assert [(r.micro_batch, r.error) for r in failed] == [(1, "out of memory at micro-batch 1")] * len(bench.ROWS)


def test_time_limit_skips_rows_that_would_not_fit():
    """A row starts only if the time so far plus the longest row so far fits under --time-limit;
    the rows left out are listed as not measured."""
    bench = _load_script()
    args = bench.parse_args(["--cpu-smoke", "--rows", "no-kernels,no-kernels-compile", "--time-limit", "300"])
    spec = args.specs[0]
    args.clock.longest_row_s = 250.0  # as if a row had taken that long
    args.clock.start -= 60.0  # and a minute had passed: 60 + 250 > 300
    results = bench.run_model(spec, args.row_list, torch.device("cpu"), None, args)
    assert [(r.row.key, r.skipped) for r in results] == [("no-kernels", "--time-limit 300 s reached"),
                                                        ("no-kernels-compile", "--time-limit 300 s reached")]
    text = bench.table([spec], {spec.name: results})
    assert "| gpt2-tiny | megalite, torch reference ops (fused_kernels=False) | 2 x 32 | not measured: --time-limit " \
           "300 s reached |" in text
    assert bench.targets([spec], {spec.name: results}) == ["- gpt2-tiny: no megalite row ran: targets not evaluated"]
    args.clock.start += 60.0  # 0 + 250 <= 300: the row runs
    (ran,) = bench.run_model(spec, args.row_list[:1], torch.device("cpu"), None, args)
    assert ran.measured and ran.wall_s > 0 and args.clock.longest_row_s == 250.0


def test_kernel_benchmark_process_finds_the_repository(monkeypatch):
    """bench_kernels.py is started with the repository on PYTHONPATH and the run's options."""
    bench = _load_script()
    seen = {}

    def fake_run(argv, **kwargs):
        seen.update(argv=argv, **kwargs)
        return subprocess.CompletedProcess(argv, 0, stdout="# megalite kernel benchmark\n")
    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    monkeypatch.setenv("PYTHONPATH", "/elsewhere")
    args = bench.parse_args(["--cpu-smoke", "--quick", "--kernel-ops", "rms_norm,swiglu"])
    assert bench.run_kernel_benchmark(args, 120.0) == ("# megalite kernel benchmark\n", 0)
    assert seen["argv"][1:] == [str(ROOT / "tools" / "benchmarks" / "bench_kernels.py"), "--ops", "rms_norm,swiglu",
                                "--cpu-smoke", "--quick"]
    assert seen["env"]["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/elsewhere"]
    assert seen["timeout"] == 120.0 and seen["cwd"] == ROOT


@pytest.mark.parametrize("key", ["no-kernels-compile", "kernels-compile", "no-kernels"])
def test_compile_rows_compile_as_the_driver_does(key, monkeypatch):
    """A megalite compile row calls GPTModel.compile_regions -- the method --torch-compile's
    setup_run calls -- with the row's backend and mode; an eager row compiles nothing."""
    from megalite.model.gpt import GPTModel

    bench = _load_script()
    seen = []
    monkeypatch.setattr(GPTModel, "compile_regions", lambda model, **kwargs: seen.append((model, kwargs)))
    args = bench.parse_args(["--cpu-smoke", "--compile-mode", "max-autotune-no-cudagraphs"])
    row = next(r for r in bench.ROWS if r.key == key)
    bench.build_step(args.specs[0], row, torch.device("cpu"), args)
    expected = [{"backend": "aot_eager", "mode": "max-autotune-no-cudagraphs"}] if row.compiled else []
    assert [kwargs for _, kwargs in seen] == expected
    assert all(isinstance(model, GPTModel) for model, _ in seen)
