"""Host time per call of megalite's kernel ops: what an op costs the CPU around its Triton
launches (argument checks, impl choice, operator dispatch, autograd, grid choice, Triton's
argument binding and specialisation), beside a trivial Triton launch timed the same way.

    python tools/benchmarks/bench_host_overhead.py [--calls 300] [--ops rms_norm,swiglu] [--shape 8,2048]

Without a GPU (the point of it: CI and laptops): the launch itself is excluded. Triton's driver
is replaced by a host-only one (HostOnlyDriver: an sm_90 target, kernels compiled for it on first
use by Triton's own compiler, and a launcher that counts launches instead of calling the CUDA
driver), and the ops run on CPU tensors standing in for CUDA ones: megalite's device check is told
the CPU runs Triton, as it is under the interpreter. Everything in Python up to the driver's launch
call runs as on a GPU; what differs is the allocator (the CPU's, not CUDA's caching allocator), the
autograd engine (the backward runs on the calling thread instead of handing over to a device
thread) and the torch ops around the kernels, which compute on the CPU (the [programs, h] partial
sums of a norm backward: 4 rows here, one per persistent program as on the CPU).

With a GPU: real launches on CUDA tensors, wall time of --calls calls after warm-up with a
synchronise at both ends (how issue 23 measured the H200), beside the torch op each replaces.

Per op: microseconds per forward call and per backward (forward + backward minus forward), the
Triton launches in each, and the time added to those launches: total - launches x trivial launch,
and for the backward also minus the autograd round trip every backward pays (torch.autograd.grad
through a no-op autograd.Function, timed the same way and printed above the table).
Times are the fastest of several batches (other processes only ever add time); without a GPU
they are this thread's CPU time, so a busy machine inflates them less. Prints a markdown table.
"""

import argparse
import datetime
import os
import platform
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, without `pip install -e .`

OPS = ("rms_norm", "layer_norm", "swiglu", "bias_gelu", "rotary", "cross_entropy")


class HostOnlyDriver:
    """A Triton driver for a machine without a GPU: the current target is an H100 (sm_90), so
    JITFunction.run binds, specialises and compiles exactly as on one, and the launcher it gets
    for a compiled kernel counts the launch instead of making it."""

    def __init__(self):
        self.launches = 0
        self.utils = SimpleNamespace(load_binary=lambda name, kernel, shared, device: (1, 1, 0, 0, 1024),
                                     get_device_properties=lambda device: {"max_shared_mem": 232448},
                                     unload_module=lambda module: None)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)

    def get_active_torch_device(self):
        return torch.device("cpu")

    def launcher_cls(self, src, metadata):
        def launch(*args):
            self.launches += 1
        return launch


def install_host_only_driver() -> HostOnlyDriver:
    """Make Triton launch through a HostOnlyDriver and megalite accept CPU tensors for its Triton
    path (compiled kernels, TRITON_INTERPRET unset)."""
    from triton.runtime.driver import driver

    from megalite.kernels import triton_common

    host = HostOnlyDriver()
    driver.set_active(host)
    triton_common.INTERPRETED = True  # read by dispatch.check_triton_device only; kernels stay compiled
    return host


def _trivial_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def _trivial(X, n, BLOCK: tl.constexpr):
        offsets = tl.arange(0, BLOCK)
        tl.store(X + offsets, 1.0, mask=offsets < n)

    out = torch.empty(128, device=DEVICE)
    return lambda: _trivial[(1,)](out, 128, BLOCK=128)


def per_call_us(fn, calls: int) -> float:
    """Microseconds per call of fn after warm-up. On a GPU: wall time of `calls` calls between two
    synchronises, the fastest of 5 such batches. Without one: this thread's CPU time, the fastest
    of 200 batches of 25 calls (other processes on the machine only ever add time, and a short
    batch often runs between them)."""
    for _ in range(3):
        fn()
    if DEVICE.type == "cuda":
        best = float("inf")
        for _ in range(5):
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            torch.cuda.synchronize()
            best = min(best, (time.perf_counter() - start) / calls * 1e6)
        return best
    best = float("inf")
    for _ in range(200):
        start = time.thread_time_ns()
        for _ in range(25):
            fn()
        best = min(best, (time.thread_time_ns() - start) / 25 / 1e3)
    return best


def cases(tokens: int, hidden: int, impl: str):
    """op -> (inputs needing grad, grad of the output, fn(*inputs), the torch op it replaces or None)."""
    from megalite import kernels

    bf16 = dict(device=DEVICE, dtype=torch.bfloat16)

    def randn(*shape, grad=True):
        return torch.randn(*shape, **bf16).requires_grad_(grad)

    heads, head_dim = max(1, hidden // 128), 128
    angles = torch.rand(tokens, 1, head_dim // 2, device=DEVICE) * 100
    cos, sin = torch.cat((angles, angles), -1).cos(), torch.cat((angles, angles), -1).sin()
    vocab = 32000
    target = torch.randint(0, vocab, (tokens,), device=DEVICE)
    h = (hidden,)
    return {
        "rms_norm": ([randn(tokens, hidden), randn(hidden)], randn(tokens, hidden, grad=False),
                     lambda x, w: kernels.rms_norm(x, w, 1e-6, impl=impl),
                     (lambda x, w: F.rms_norm(x, h, w, 1e-6)) if hasattr(F, "rms_norm") else None),
        "layer_norm": ([randn(tokens, hidden), randn(hidden), randn(hidden)], randn(tokens, hidden, grad=False),
                       lambda x, w, b: kernels.layer_norm(x, w, b, 1e-5, impl=impl),
                       lambda x, w, b: F.layer_norm(x, h, w, b, 1e-5)),
        "swiglu": ([randn(tokens, 2 * hidden)], randn(tokens, hidden, grad=False),
                   lambda x: kernels.swiglu(x, impl=impl), lambda x: F.silu(x[:, :hidden]) * x[:, hidden:]),
        "bias_gelu": ([randn(tokens, hidden), randn(hidden)], randn(tokens, hidden, grad=False),
                      lambda x, b: kernels.bias_gelu(x, b, "tanh", impl=impl),
                      lambda x, b: F.gelu(x + b, approximate="tanh")),
        "rotary": ([randn(tokens, 1, heads, head_dim)], randn(tokens, 1, heads, head_dim, grad=False),
                   lambda x: kernels.apply_rotary(x, cos, sin, impl=impl), None),
        "cross_entropy": ([randn(tokens, vocab)], torch.rand(tokens, device=DEVICE),
                          lambda z: kernels.cross_entropy(z, target, impl=impl),
                          lambda z: F.cross_entropy(z.float(), target, reduction="none")),
    }


def measure(name: str, inputs, grad_out, fn, calls: int, counter) -> dict:
    def forward():
        return fn(*inputs)

    def forward_backward():
        torch.autograd.grad(fn(*inputs), inputs, grad_out)

    launches = []  # None where launches are not counted (a real GPU)
    for step in (forward, forward_backward):
        before = counter()
        step()
        launches.append(None if before is None else counter() - before)
    fwd = per_call_us(forward, calls)
    both = per_call_us(forward_backward, calls)
    bwd_launches = None if launches[0] is None else launches[1] - launches[0]
    return dict(op=name, fwd_us=fwd, fwd_launches=launches[0], bwd_us=both - fwd, bwd_launches=bwd_launches)


class _NoOp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def autograd_round_trip_us(calls: int) -> float:
    """Backward time of a no-op autograd.Function: torch.autograd.grad's own cost."""
    x = torch.randn(8, 8, device=DEVICE, requires_grad=True)
    dy = torch.randn(8, 8, device=DEVICE)
    both = per_call_us(lambda: torch.autograd.grad(_NoOp.apply(x), [x], dy), calls)
    return both - per_call_us(lambda: _NoOp.apply(x), calls)


def markdown(rows: list[dict], trivial: float, round_trip: float) -> str:
    lines = [f"trivial Triton launch: {trivial:.1f} us per call; autograd round trip (backward of a no-op "
             f"autograd.Function): {round_trip:.1f} us\n",
             "| op | impl | fwd us | launches | fwd added us | bwd us | launches | bwd added us |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        known = r["fwd_launches"] is not None
        fwd_added = f"{r['fwd_us'] - r['fwd_launches'] * trivial:.1f}" if known else "-"
        bwd_added = f"{r['bwd_us'] - r['bwd_launches'] * trivial - round_trip:.1f}" if known else "-"
        lines.append(f"| {r['op']} | {r['impl']} | {r['fwd_us']:.1f} | {r['fwd_launches'] if known else '-'} | "
                     f"{fwd_added} | {r['bwd_us']:.1f} | {r['bwd_launches'] if known else '-'} | {bwd_added} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    global DEVICE
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ops", default=",".join(OPS), help="comma-separated subset of ops")
    parser.add_argument("--calls", type=int, default=300, help="calls per timed batch on a GPU")
    parser.add_argument("--shape", default="8,2048", help="tokens,hidden of the inputs (default 8,2048)")
    args = parser.parse_args(argv)
    ops = args.ops.split(",")
    if not set(ops) <= set(OPS):
        parser.error(f"--ops: unknown {sorted(set(ops) - set(OPS))}; choose from {list(OPS)}")
    tokens, hidden = (int(v) for v in args.shape.split(","))
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("bench_host_overhead: unset TRITON_INTERPRET (it times compiled Triton's launch path)", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    on_gpu = torch.cuda.is_available()
    DEVICE = torch.device("cuda" if on_gpu else "cpu")
    if on_gpu:
        counter = lambda: None  # noqa: E731 - real launches are not counted
        where = f"{torch.cuda.get_device_name()}, real launches"
    else:
        host = install_host_only_driver()
        counter = lambda: host.launches  # noqa: E731
        where = "no GPU: launches stubbed (HostOnlyDriver), CPU tensors"
    import triton

    print(f"# megalite host overhead per call, {datetime.date.today().isoformat()}\n")
    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs; {where}; torch {torch.__version__}; "
          f"triton {triton.__version__}; inputs [{tokens}, {hidden}] bf16")
    print(f"command: python {' '.join(sys.argv)}\n")
    trivial = per_call_us(_trivial_kernel(), args.calls)
    round_trip = autograd_round_trip_us(args.calls)
    rows = []
    for name, (inputs, grad_out, fn, peer) in cases(tokens, hidden, "triton").items():
        if name not in ops:
            continue
        rows.append(dict(measure(name, inputs, grad_out, fn, args.calls, counter), impl="megalite triton"))
        if on_gpu and peer is not None:
            rows.append(dict(measure(name, inputs, grad_out, peer, args.calls, counter), impl="torch op",
                             fwd_launches=None, bwd_launches=None))
    if on_gpu:
        for r in rows:
            if r["impl"] == "megalite triton":
                r["fwd_launches"] = r["bwd_launches"] = None  # not counted on a GPU
    print(markdown(rows, trivial, round_trip))
    return 0


DEVICE = torch.device("cpu")

if __name__ == "__main__":
    sys.exit(main())
