"""Time megalite's Triton kernels against their torch references on one GPU.

    python tools/benchmarks/bench_kernels.py [--quick] [--ops rms_norm,cross_entropy] [--compile]
                                             [--write-table megalite/kernels/speed_table.py]

For each op, forward and backward are timed separately (CUDA events, median of several batches)
for the Triton kernel (impl="triton"), the plain-torch reference megalite uses when kernels are
off (impl="torch"), and where it exists a named peer: torch's own fused op (F.rms_norm,
F.layer_norm on bf16) or F.cross_entropy on fp32 logits; --compile adds torch.compile of the
reference. Each batch is queued behind a GPU-side sleep (torch.cuda._sleep) long enough for the
host to enqueue all of it, so the events time the GPU's work, not the host's speed at issuing it
(tools/benchmarks/bench_host_overhead.py times that). Achieved bandwidth is bytes moved / time,
where bytes count each activation read or written once (weights, per-row statistics and partial
sums excluded), compared with the device's measured copy bandwidth (a large bf16 x.copy_, read +
write). Prints a markdown table, then the verdicts for megalite/kernels/speed_table.py: for each
op and shape class, whether impl="auto" should run Triton or the torch reference on this GPU
class (the faster forward + backward); --write-table records them in that file.

Without a GPU it says so and exits 0; --cpu-smoke runs tiny shapes on the CPU with the torch
paths only (no Triton, no targets, even where a GPU exists), to check the harness itself.
"""

import argparse
import dataclasses
import datetime
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, without `pip install -e .`

from megalite.kernels import apply_rotary, bias_gelu, cross_entropy, layer_norm, rms_norm, swiglu  # noqa: E402
from megalite.kernels import speed_table  # noqa: E402
from megalite.kernels.speed_table import shape_class  # noqa: E402

NORM_TARGET = 0.80  # issue 7: normalisation kernels at >= 80% of measured copy bandwidth
OPS = ("rms_norm", "layer_norm", "swiglu", "bias_gelu", "rotary", "cross_entropy")


@dataclasses.dataclass
class Case:
    op: str
    shape: str
    make_inputs: Callable[[], tuple[list[torch.Tensor], torch.Tensor]]  # (inputs needing grad, grad of output)
    impls: dict[str, Callable[..., torch.Tensor]]  # label -> fn(*inputs)
    bytes_fwd: int
    bytes_bwd: int
    table_key: str = ""  # speed_table.shape_class of the op's dispatch name and main input's width


def _timer(device: torch.device, batches: int, per_batch: int):
    sleep_cycles_per_ms = _sleep_rate(device) if device.type == "cuda" else 0.0

    def run(fn: Callable[[], object]) -> float:
        """Median milliseconds per call of fn over `batches` batches of `per_batch` calls."""
        fn()  # warm-up (compiles Triton kernels / torch.compile graphs)
        times = []
        for _ in range(batches):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                t0 = time.perf_counter()
                for _ in range(per_batch):
                    fn()
                host_ms = (time.perf_counter() - t0) * 1e3  # how long the host takes to enqueue a batch
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(int(2 * host_ms * sleep_cycles_per_ms) + 1000)  # the GPU waits while the host queues
                start.record()
                for _ in range(per_batch):
                    fn()
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end) / per_batch)
            else:
                t0 = time.perf_counter()
                for _ in range(per_batch):
                    fn()
                times.append((time.perf_counter() - t0) * 1e3 / per_batch)
        return statistics.median(times)
    return run


def _sleep_rate(device: torch.device) -> float:
    """GPU clock cycles per millisecond of torch.cuda._sleep, measured."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(1000)
    start.record()
    torch.cuda._sleep(10_000_000)
    end.record()
    torch.cuda.synchronize(device)
    return 10_000_000 / start.elapsed_time(end)


def copy_bandwidth(device: torch.device, timer, n_bytes: int) -> float:
    """Measured device copy bandwidth in GB/s (bytes read + written per second)."""
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    ms = timer(lambda: dst.copy_(src))
    return 2 * n_bytes / ms / 1e6


def build_cases(device: torch.device, dtype: torch.dtype, sizes: dict, with_triton: bool, with_compile: bool,
                ops: set[str]) -> list[Case]:
    e = torch.empty((), dtype=dtype).element_size()
    n, h, f, vocab_sizes = sizes["tokens"], sizes["hidden"], sizes["ffn"], sizes["vocab"]
    s, b, heads, head_dim = sizes["rotary"]

    def randn(*shape, scale=1.0, grad=True):
        return (scale * torch.randn(*shape, device=device, dtype=dtype)).requires_grad_(grad)

    def impls(triton_fn, torch_fn, peers=None, compile_fn=None):
        out = {}
        if with_triton:
            out["triton"] = triton_fn
        out["torch reference"] = torch_fn
        out.update(peers or {})
        if with_compile:
            out["torch.compile(reference)"] = torch.compile(compile_fn or torch_fn)
        return out

    cases = []
    if "rms_norm" in ops:
        cases.append(Case(
            "rms_norm", f"[{n}, {h}]", lambda: ([randn(n, h), randn(h)], randn(n, h, grad=False)),
            impls(lambda x, w: rms_norm(x, w, 1e-6, impl="triton"), lambda x, w: rms_norm(x, w, 1e-6, impl="torch"),
                  {"F.rms_norm (bf16)": lambda x, w: F.rms_norm(x, (h,), w, 1e-6)} if hasattr(F, "rms_norm") else {}),
            2 * n * h * e, 3 * n * h * e, shape_class("rms_norm", h)))
    if "layer_norm" in ops:
        cases.append(Case(
            "layer_norm", f"[{n}, {h}]", lambda: ([randn(n, h), randn(h), randn(h)], randn(n, h, grad=False)),
            impls(lambda x, w, bb: layer_norm(x, w, bb, 1e-5, impl="triton"),
                  lambda x, w, bb: layer_norm(x, w, bb, 1e-5, impl="torch"),
                  {"F.layer_norm (bf16)": lambda x, w, bb: F.layer_norm(x, (h,), w, bb, 1e-5)}),
            2 * n * h * e, 3 * n * h * e, shape_class("layer_norm", h)))
    if "swiglu" in ops:
        cases.append(Case(
            "swiglu", f"[{n}, 2x{f}]", lambda: ([randn(n, 2 * f)], randn(n, f, grad=False)),
            impls(lambda x: swiglu(x, impl="triton"), lambda x: swiglu(x, impl="torch"),
                  {"silu(g)*u (bf16)": lambda x: F.silu(x[:, :f]) * x[:, f:]}),
            3 * n * f * e, 5 * n * f * e, shape_class("swiglu", 2 * f)))
    if "bias_gelu" in ops:
        cases.append(Case(
            "bias_gelu (tanh)", f"[{n}, {4 * h}]", lambda: ([randn(n, 4 * h), randn(4 * h)], randn(n, 4 * h, grad=False)),
            impls(lambda x, bb: bias_gelu(x, bb, "tanh", impl="triton"),
                  lambda x, bb: bias_gelu(x, bb, "tanh", impl="torch"),
                  {"gelu(x+b) (bf16)": lambda x, bb: F.gelu(x + bb, approximate="tanh")}),
            2 * n * 4 * h * e, 3 * n * 4 * h * e, shape_class("bias_gelu", 4 * h)))
    if "rotary" in ops:
        angles = torch.rand(s, 1, head_dim // 2, device=device) * 100
        emb = torch.cat((angles, angles), dim=-1)
        cos, sin = emb.cos(), emb.sin()
        cases.append(Case(
            "apply_rotary", f"[{s}, {b}, {heads}, {head_dim}]",
            lambda: ([randn(s, b, heads, head_dim)], randn(s, b, heads, head_dim, grad=False)),
            impls(lambda x: apply_rotary(x, cos, sin, impl="triton"), lambda x: apply_rotary(x, cos, sin, impl="torch")),
            2 * s * b * heads * head_dim * e, 2 * s * b * heads * head_dim * e,
            shape_class("apply_rotary", head_dim)))
    if "cross_entropy" in ops:
        for vocab in vocab_sizes:
            target = torch.randint(0, vocab, (n,), device=device)
            cases.append(Case(
                "cross_entropy", f"[{n}, {vocab}]",
                lambda vocab=vocab: ([randn(n, vocab, scale=4.0)], torch.rand(n, device=device)),
                impls(lambda z, t=target: cross_entropy(z, t, impl="triton"),
                      lambda z, t=target: cross_entropy(z, t, impl="torch"),
                      {"F.cross_entropy(fp32 logits)": lambda z, t=target: F.cross_entropy(z.float(), t, reduction="none")},
                      compile_fn=lambda z, t=target: F.cross_entropy(z.float(), t, reduction="none")),
                n * vocab * e, 2 * n * vocab * e, shape_class("cross_entropy", vocab)))
    return cases


def run_case(case: Case, timer, device: torch.device, copy_gbps: float) -> list[dict]:
    rows = []
    for label, fn in case.impls.items():
        inputs, grad_out = case.make_inputs()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            base = torch.cuda.memory_allocated(device)
        fwd_ms = timer(lambda: fn(*inputs))
        out = fn(*inputs)
        bwd_ms = timer(lambda: torch.autograd.grad(out, inputs, grad_out, retain_graph=True))
        peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20 if device.type == "cuda" else float("nan")
        total = fwd_ms + bwd_ms
        gbps = (case.bytes_fwd + case.bytes_bwd) / total / 1e6
        rows.append(dict(op=case.op, shape=case.shape, impl=label, table_key=case.table_key, fwd_ms=fwd_ms,
                         bwd_ms=bwd_ms, total_ms=total,
                         fwd_frac=case.bytes_fwd / fwd_ms / 1e6 / copy_gbps,
                         bwd_frac=case.bytes_bwd / bwd_ms / 1e6 / copy_gbps,
                         gbps=gbps, frac=gbps / copy_gbps, peak_mib=peak))
        del inputs, grad_out, out
    reference = next(r for r in rows if r["impl"] == "torch reference")
    for r in rows:
        r["speedup"] = reference["total_ms"] / r["total_ms"]
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| op | shape | impl | fwd ms | bwd ms | fwd+bwd ms | GB/s | % copy BW (fwd / bwd / both) "
             "| peak MiB | vs reference |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['shape']} | {r['impl']} | {r['fwd_ms']:.3f} | {r['bwd_ms']:.3f} | "
                     f"{r['total_ms']:.3f} | {r['gbps']:.0f} | {100 * r['fwd_frac']:.0f} / {100 * r['bwd_frac']:.0f} / "
                     f"{100 * r['frac']:.0f} | {r['peak_mib']:.0f} | {r['speedup']:.2f}x |")
    return "\n".join(lines)


def verdicts(rows: list[dict]) -> dict[str, str]:
    """speed_table entries: per shape class, "torch" where the torch reference's forward + backward
    beat the Triton kernel's, else "triton"."""
    out = {}
    for key in dict.fromkeys(r["table_key"] for r in rows):
        by_impl = {r["impl"]: r["total_ms"] for r in rows if r["table_key"] == key}
        if "triton" in by_impl:
            out[key] = "torch" if by_impl["torch reference"] < by_impl["triton"] else "triton"
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of ops to time")
    parser.add_argument("--quick", action="store_true", help="a quarter of the tokens, fewer repetitions")
    parser.add_argument("--compile", action="store_true", help="also time torch.compile of the references")
    parser.add_argument("--write-table", metavar="PATH",
                        help="record this GPU class's verdicts in PATH (megalite/kernels/speed_table.py)")
    parser.add_argument("--cpu-smoke", action="store_true",
                        help="no GPU: run tiny shapes on the CPU, torch paths only (checks the harness)")
    args = parser.parse_args(argv)
    ops = set(args.ops.split(","))
    known = set(OPS)
    if not ops <= known:
        parser.error(f"--ops: unknown {sorted(ops - known)}; choose from {sorted(known)}")

    if args.cpu_smoke:
        device, with_triton = torch.device("cpu"), False
        sizes = dict(tokens=64, hidden=256, ffn=512, vocab=[1000], rotary=(16, 2, 4, 32))
        timer = _timer(device, batches=3, per_batch=2)
        copy_bytes = 1 << 24
    elif torch.cuda.is_available():
        device, with_triton = torch.device("cuda"), True
        tokens = 8 * 2048 // (4 if args.quick else 1)
        sizes = dict(tokens=tokens, hidden=4096, ffn=14336, vocab=[50304, 128256],
                     rotary=(2048 // (4 if args.quick else 1), 8, 32, 128))
        timer = _timer(device, batches=5, per_batch=3 if args.quick else 10)
        copy_bytes = 1 << 30
    else:
        print("bench_kernels: no CUDA device, nothing to time (Triton kernels need a GPU; "
              "--cpu-smoke runs the harness on tiny CPU shapes with the torch paths only)")
        return 0

    import importlib.metadata as md

    triton_version = md.version("triton") if with_triton else "not used"
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (smoke run: torch paths only, no targets)"
    copy_gbps = copy_bandwidth(device, timer, copy_bytes)
    print(f"# megalite kernel benchmark, {datetime.date.today().isoformat()}\n")
    print(f"device: {name}; torch {torch.__version__}; triton {triton_version}; dtype bf16")
    print(f"measured copy bandwidth: {copy_gbps:.0f} GB/s (x.copy_ of {copy_bytes >> 20} MiB bf16, read + write)")
    print(f"command: python {' '.join(sys.argv)}\n")

    rows = []
    for case in build_cases(device, torch.bfloat16, sizes, with_triton, args.compile, ops):
        rows += run_case(case, timer, device, copy_gbps)
    print(markdown(rows))
    if with_triton:
        norms = [r for r in rows if r["op"] in ("rms_norm", "layer_norm") and r["impl"] == "triton"]
        for r in norms:
            verdict = "meets" if min(r["fwd_frac"], r["bwd_frac"]) >= NORM_TARGET else "MISSES"
            print(f"\n{r['op']}: forward {100 * r['fwd_frac']:.0f}%, backward {100 * r['bwd_frac']:.0f}% of copy "
                  f"bandwidth: {verdict} the {100 * NORM_TARGET:.0f}% target", end="")
        print()
        gpu = speed_table.gpu_class(device)
        table = verdicts(rows)
        print(f"\nspeed_table verdicts for {gpu} (impl='auto'): {json.dumps(table)}")
        if args.write_table:
            speed_table.rewrite(args.write_table, gpu, table)
            print(f"written to {args.write_table}")
    elif args.write_table:
        print("bench_kernels: --write-table needs a GPU run (the CPU smoke run times no Triton)", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
