"""The planner's GPU model (gpu_kernels.py) against the three driver runs issue 23 measured on
one H200 (2026-11-26, torch 2.11.0+cu130, triton 3.6.0; ms per step as the driver logged it),
the h200 preset, the measured constants recounted from the traffic model, the traffic model
recounted from megalite's own GPU code path (a dry run on fake CUDA, traffic_trace.py), and each
modelled term shown to matter: without it a prediction leaves its band."""

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megalite import kernels
from megalite.planner.cli import main
from megalite.planner.cluster import GIB, H200_KERNELS, ISSUE23_PROFILE, KERNEL_CLASSES, Cluster, KernelRates, preset
from megalite.planner.gpu_kernels import REFERENCE, attention_seconds, host_bound, step_traffic
from megalite.planner.layouts import Layout
from megalite.planner.parameters import rank_parameters
from megalite.planner.step import predict
from megalite.planner.workload import from_flags
from tests.planner.traffic_trace import moved_bytes

REPO = Path(__file__).resolve().parents[2]
LLAMA_1B = ("--num-layers 16 --hidden-size 2048 --num-attention-heads 16 --group-query-attention --num-query-groups 8 "
            "--ffn-hidden-size 8192 --swiglu --normalization RMSNorm --position-embedding-type rope "
            "--disable-bias-linear --untie-embeddings-and-output-weights --seq-length 4096 --global-batch-size 4 "
            "--bf16 --attention-backend flash --tokenizer-type NullTokenizer --vocab-size 32000").split()
LLAMA3_8B_4L = ("--num-layers 4 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
                "--num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm "
                "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
                "--seq-length 8192 --global-batch-size 2 --bf16 --attention-backend flash --tokenizer-type "
                "NullTokenizer --vocab-size 128256").split()
# issue 23, "What was measured": ms per step on the H200 (the first run: 298.5-302.1 ms). These runs
# predate gradient accumulation fusion and the bias-dropout-add kernel, so they are modelled without
# them (as they ran).
UNFUSED = ["--no-gradient-accumulation-fusion", "--no-bias-dropout-fusion"]
RUNS = {  # name: (model flags, micro-batch, recompute, measured ms, tolerance)
    "1.1B": (LLAMA_1B + UNFUSED, 2, "none", 300.0, 0.08),  # the issue's 5% not met: see test_1p1b_within_5_percent
    "8B layers, DO": (LLAMA3_8B_4L + UNFUSED, 1, "none", 360.6, 0.05),  # --use-distributed-optimizer: one rank
    "1.1B full recompute": (LLAMA_1B + UNFUSED, 2, "full", 363.0, 0.05),
}
# They also predate the QKV split's one-cat backward (issue 30), which the model counts now: 7-8 ms
# less on the 1.1B runs' H200 step, so those two predictions fall outside their bounds until the next
# GPU run measures the current code.
STALE = pytest.mark.xfail(strict=True, reason="measured before the QKV split's one-cat backward; the model "
                                              "predicts the current code (the next GPU run re-measures)")


def predicted_ms(name: str, cluster: Cluster) -> float:
    flags, mbs, recompute, _, _ = RUNS[name]
    layout = Layout(1, 1, 1, micro_batch_size=mbs, recompute=recompute, schedule="none")
    return predict(cluster, from_flags(flags), layout).step_time * 1e3


@pytest.mark.parametrize("name", [pytest.param(n, marks=STALE) if n.startswith("1.1B") else n for n in RUNS])
def test_issue23_runs_predicted_beside_measured(name):
    measured, tolerance = RUNS[name][3], RUNS[name][4]
    assert predicted_ms(name, preset("h200", 1)) == pytest.approx(measured, rel=tolerance)
    # the h100 preset: the same kernels on less memory bandwidth, never faster than the H200
    assert predicted_ms(name, preset("h100", 1)) > predicted_ms(name, preset("h200", 1))


# The first H100 run (2026-11-26, gpu_check.sh: H100 80GB HBM3, torch 2.11.0+cu130, triton 3.6.0,
# the kernels and host path rebuilt since the H200 run): ms per step, median of iterations 3-8.
H100_MEASURED = {"1.1B": 316.7, "8B layers, DO": 416.0, "1.1B full recompute": 396.5}


@pytest.mark.parametrize("name", H100_MEASURED)
def test_h100_runs_within_5_percent(name):
    """Issue 23's planner target, met on an H100 with the h100 preset (-0.2%, +2.2%, -0.6% then)."""
    assert predicted_ms(name, preset("h100", 1)) == pytest.approx(H100_MEASURED[name], rel=0.05)


@pytest.mark.xfail(strict=True, reason="issue 23's 5% target for the 1.1B run is not met (-7%): about 20 ms of "
                                       "its 300 ms step are not kernel time in this model (see notes)")
def test_1p1b_within_5_percent():
    assert predicted_ms("1.1B", preset("h200", 1)) == pytest.approx(300.0, rel=0.05)


def test_h200_preset():
    h200 = preset("h200", 8)
    assert (h200.peak_flops, h200.memory_bytes, h200.memory_bandwidth) == (989.4e12, 139 * GIB, 4244e9)
    assert h200.intra_node_bandwidth == 450e9 * 0.8 and h200.gpus_per_node == 8
    assert h200.kernels is H200_KERNELS and H200_KERNELS.copy_bandwidth == 4244e9
    h100 = preset("h100", 8)
    assert h100.kernels.copy_bandwidth == pytest.approx(4244e9 * 3.35 / 4.8)
    assert {k: getattr(h100.kernels, k) for k in KERNEL_CLASSES} == {k: getattr(h200.kernels, k) for k in KERNEL_CLASSES}


def test_measured_constants_are_the_models_own_counts():
    """ISSUE23_PROFILE divides the profiled kernel times by what gpu_kernels.py counts for the
    same kernels of the profiled run: recounted here, so that the traffic model and the rates
    cannot drift apart."""
    workload = from_flags(LLAMA_1B)
    layout = Layout(1, 1, 1, micro_batch_size=2, schedule="none")
    traffic = step_traffic(workload, layout)
    assert ISSUE23_PROFILE["norm"][1] == traffic["norm"][1]
    assert ISSUE23_PROFILE["swiglu"][1] == traffic["swiglu"][1]
    params = sum(rank_parameters(workload.config, 1, 1, 1, 0))
    assert ISSUE23_PROFILE["torch"][1] == 2 * params * (2 + 4 + 4)  # the fp32 adds: 198 = 2 x 99 tensors
    assert ISSUE23_PROFILE["optimizer"][1] == params * (4 + 8 + 28)
    rate = preset("h200", 1).peak_flops * H200_KERNELS.attention
    backward = attention_seconds(preset("h200", 1), workload, layout, 2 * 4096)[1]
    assert 16 * 2 * backward == pytest.approx(ISSUE23_PROFILE["attention"][0])
    assert 16 * 2 * backward * rate == pytest.approx(ISSUE23_PROFILE["attention"][1])


@pytest.mark.parametrize("term, change", [
    ("flash attention at its own efficiency", lambda k: replace(k, attention=792.1 / 989.4)),
    ("memory-bound classes at their measured rates", lambda k: replace(k, **dict.fromkeys(KERNEL_CLASSES[:-1], 1.0))),
    ("megalite's norm kernels at their measured 25%", lambda k: replace(k, norm=1.0)),
    ("torch's elementwise kernels at their measured 62%", lambda k: replace(k, torch=1.0)),
])
def test_each_modelled_term_is_needed(term, change):
    """Without the term (its rate replaced by the roofline's), some run leaves its band."""
    cluster = preset("h200", 1)
    ablated = cluster.replace(kernels=change(cluster.kernels))
    misses = [name for name in RUNS if abs(predicted_ms(name, ablated) / RUNS[name][3] - 1) > RUNS[name][4]]
    assert misses, f"{term}: every run still within its band without it"


def test_host_bound_waits():
    # forward: the GPU waits for the host; backward: the lead the host built is used up first
    assert host_bound(1.0, 2.0, 3.0, 0.5) == (2.0, 0.0)
    assert host_bound(2.0, 2.0, 1.0, 2.0) == (0.0, 0.0)
    assert host_bound(2.0, 1.0, 1.0, 3.0) == (0.0, 1.0)
    # a small model on the GPU is host-bound: its step is longer than its kernels, by the host's calls
    small = from_flags("--num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --global-batch-size 2 "
                       "--bf16 --tokenizer-type NullTokenizer --vocab-size 1000 --normalization RMSNorm".split())
    layout = Layout(1, 1, 1, micro_batch_size=1, schedule="none")
    h200 = preset("h200", 1)
    prediction = predict(h200, small, layout)
    assert prediction.breakdown["operators"] > prediction.breakdown["memory-bound"] > 0
    free_host = h200.replace(kernels=replace(h200.kernels, host={op: [0.0, 0.0] for op in h200.kernels.host}))
    assert predict(free_host, small, layout).step_time == pytest.approx(
        prediction.step_time - prediction.breakdown["operators"], rel=1e-9)


class _Counter(TorchDispatchMode):
    """Bytes and operators (traffic_trace.py's rules) of what runs under it."""

    def __init__(self):
        super().__init__()
        self.bytes, self.ops = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        moved = moved_bytes(func, args, kwargs, out)
        if moved is not None:
            self.bytes += moved
            self.ops += 1
        return out


@pytest.mark.parametrize("op", list(REFERENCE))
def test_reference_traffic_is_recounted(op):
    n, h = 512, 256
    shapes = {"rms_norm": [(n, h), (h,)], "layer_norm": [(n, h), (h,), (h,)], "swiglu": [(n, 2 * h)],
              "bias_gelu": [(n, h), (h,)], "rotary": [(n // 8, 4, 16, 64)]}[op]
    cos, sin = torch.randn(n // 8, 1, 64), torch.randn(n // 8, 1, 64)
    call = {"rms_norm": lambda x, w: kernels.rms_norm(x, w, impl="torch"),
            "layer_norm": lambda x, w, b: kernels.layer_norm(x, w, b, impl="torch"),
            "swiglu": lambda x: kernels.swiglu(x, impl="torch"),
            "bias_gelu": lambda x, b: kernels.bias_gelu(x, b, "tanh", impl="torch"),
            "rotary": lambda x: kernels.apply_rotary(x, cos, sin, impl="torch")}[op]
    inputs = [torch.randn(*s, dtype=torch.bfloat16, requires_grad=True) for s in shapes]
    forward, backward = _Counter(), _Counter()
    with forward:
        out = call(*inputs)
    grad = torch.randn_like(out)
    with backward:
        out.backward(grad)
    unit = out.numel() * 2
    assert (round(forward.bytes / unit), round(backward.bytes / unit), forward.ops, backward.ops) == REFERENCE[op]


TRACED = {
    "llama, torch cross-entropy": "--num-layers 2 --hidden-size 512 --num-attention-heads 4 --group-query-attention "
    "--num-query-groups 2 --ffn-hidden-size 1408 --swiglu --normalization RMSNorm --position-embedding-type rope "
    "--disable-bias-linear --untie-embeddings-and-output-weights --attention-backend flash",
    "gpt, fused cross-entropy": "--num-layers 2 --hidden-size 512 --num-attention-heads 8 --ffn-hidden-size 2048 "
    "--max-position-embeddings 512 --cross-entropy-loss-fusion",
}


@pytest.mark.parametrize("name", TRACED)
def test_traffic_model_matches_megalites_gpu_code_path(name):
    common = "--seq-length 512 --global-batch-size 4 --bf16 --tokenizer-type NullTokenizer --vocab-size 4000".split()
    flags = TRACED[name].split() + common
    run = subprocess.run([sys.executable, str(REPO / "tests/planner/traffic_trace.py"), *flags,
                          "--micro-batch-size", "2"], capture_output=True, text=True, timeout=600, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    traced = json.loads(run.stdout.strip().splitlines()[-1])
    workload = from_flags(flags)
    modelled = step_traffic(workload, Layout(1, 1, 1, micro_batch_size=2, schedule="none"))
    assert set(modelled) == set(traced) - {"gemm", "attention", "optimizer"}
    for kind, (forward, backward) in modelled.items():
        assert forward == pytest.approx(traced[kind][0], rel=0.03), kind
        assert backward == pytest.approx(traced[kind][1], rel=0.03), kind
    params = sum(rank_parameters(workload.config, 1, 1, 1, 0))
    assert traced["optimizer"][0] == pytest.approx(params * (4 + 4 + 8 + 28 + 6), rel=0.01)


def test_kernel_rates_file(tmp_path, capsys):
    rates = tmp_path / "kernel_rates.json"
    rates.write_text(json.dumps({"date": "x", "kernels": dict(vars(H200_KERNELS), norm=0.9)}))
    assert KernelRates.load(str(rates)).norm == 0.9
    model = ["--", *LLAMA_1B]
    args = ["--cluster", "h200", "--num-gpus", "1", "--micro-batch-size", "2", "--recompute", "none",
            "--json", str(tmp_path / "p.json")]
    assert main(args + model) == 0
    slow_norms = json.loads((tmp_path / "p.json").read_text())[0]["step_time"]
    assert main(args + ["--kernel-rates", str(rates)] + model) == 0
    assert json.loads((tmp_path / "p.json").read_text())[0]["step_time"] < slow_norms
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"kernels": dict(vars(H200_KERNELS), norm=1.5)}))
    capsys.readouterr()
    assert main(args + ["--kernel-rates", str(bad)] + model) == 2
    err = capsys.readouterr().err.strip()
    assert "--kernel-rates" in err and "norm must be a fraction" in err and len(err.splitlines()) == 1
    saved = tmp_path / "cluster.json"
    preset("h200", 8).save(str(saved))
    assert Cluster.load(str(saved)).kernels == H200_KERNELS
