"""Compile every Triton kernel megalite launches, at realistic shapes, for an H100 (sm_90), on a
machine without a GPU, and report registers and spills.

    python -m tests.kernels.sm90_compile [bfloat16] [float32]   (TRITON_INTERPRET unset or 0)

The launch wrappers are called with tensors on the "meta" device while JITFunction.run is
replaced by a recorder, so the exact arguments, constexprs and num_warps the wrappers choose are
compiled (through Triton's full pipeline down to a cubin, with the ptxas bundled in the triton
wheel). Prints one JSON line per distinct compilation: kernel, constexprs, num_warps, registers,
spill bytes (stack), shared memory.
"""

import json
import os
import re
import subprocess
import sys
import tempfile

import torch

SHAPES_NORM = [(16384, 768), (16384, 2048), (16384, 4096), (8192, 8192), (4096, 16384)]
SHAPES_ACT = [(16384, 3072), (16384, 5504), (16384, 14336)]
SHAPES_ROTARY = [((2048, 4, 32, 128), 128, 1), ((1024, 8, 12, 64), 32, 8)]
SHAPES_CE = [(16384, 50304), (8192, 64128)]


def _record_launches(dtypes):
    """Call every launch wrapper on meta tensors of `dtypes`; return the recorded (kernel, args, kwargs)."""
    from torch._library.triton import set_wrap_triton_enabled
    from triton.runtime.jit import JITFunction

    from megalite.kernels import activations_triton, cross_entropy_triton, norms_triton, rotary_triton

    launches = []
    original = JITFunction.run
    JITFunction.run = lambda self, *args, grid, warmup, **kwargs: launches.append((self, args, kwargs))
    # On meta tensors an operator runs its fake implementation, which for a triton_op is the
    # launcher itself; with wrap_triton off, its launches call the (recording) kernels directly.
    try:
        with set_wrap_triton_enabled(False):
            meta = dict(device="meta")
            for dtype in dtypes:
                for rows, h in SHAPES_NORM:
                    x = torch.empty(rows, h, dtype=dtype, **meta)
                    w = torch.empty(h, dtype=dtype, **meta)
                    stats = torch.empty(rows, dtype=torch.float32, **meta)
                    for is_rms, bias in ((True, None), (False, w)):
                        norms_triton.norm_forward(x, w, bias, 1e-5, is_rms)
                        norms_triton.norm_backward(x, x, w, bias is not None, None if is_rms else stats, stats, is_rms)
                for rows, f in SHAPES_ACT:
                    x2 = torch.empty(rows, 2 * f, dtype=dtype, **meta)
                    y = torch.empty(rows, f, dtype=dtype, **meta)
                    b = torch.empty(f, dtype=dtype, **meta)
                    activations_triton.swiglu_forward(x2)
                    activations_triton.swiglu_backward(y, x2)
                    for bias in (b, None):
                        for tanh in (False, True):
                            activations_triton.bias_gelu_forward(y, bias, tanh)
                            activations_triton.bias_gelu_backward(y, y, bias, tanh)
                for shape, d_rot, batch in SHAPES_ROTARY:
                    x = torch.empty(shape, dtype=dtype, **meta)
                    cos = torch.empty(shape[0], batch, d_rot, dtype=torch.float32, **meta)
                    for backward in (False, True):
                        rotary_triton.rotary(x, cos, cos, backward)
                for rows, vocab in SHAPES_CE:
                    logits = torch.empty(rows, vocab, dtype=dtype, **meta)
                    target = torch.empty(rows, dtype=torch.int64, **meta)
                    stats = torch.empty(rows, dtype=torch.float32, **meta)
                    for need_sum in (False, True):
                        cross_entropy_triton.local_stats(logits, target, vocab - 3, need_sum)
                    cross_entropy_triton.grad_logits(logits, target, stats, stats, stats, vocab - 3, 0.1,
                                                     torch.empty(1, **meta))
    finally:
        JITFunction.run = original
    return launches


def _signature(kernel, args, kwargs):
    names = kernel.arg_names
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    pointer = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int64: "*i64"}
    signature, constexprs = {}, {}
    for name in names:
        value = values[name]
        if value is None or isinstance(value, bool) or name in kwargs:
            signature[name], constexprs[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            signature[name] = pointer[value.dtype]
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: cannot type argument {name}={value!r}")
    return signature, constexprs


def _resources(cubin: bytes) -> dict:
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+).*?SHARED:(\d+)", out)
    if found is None:
        raise RuntimeError(f"cuobjdump -res-usage printed no resource line:\n{out}")
    return dict(zip(("registers", "stack", "shared"), map(int, found.groups())))


def main(argv: list[str]) -> int:
    """argv: optional dtype names (default: bfloat16 float32)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("sm90_compile: unset TRITON_INTERPRET (kernels must be compiled, not interpreted)", file=sys.stderr)
        return 2
    dtypes = [getattr(torch, name) for name in (argv or ["bfloat16", "float32"])]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    target = GPUTarget("cuda", 90, 32)
    seen = set()
    for kernel, args, kwargs in _record_launches(dtypes):
        signature, constexprs = _signature(kernel, args, kwargs)
        num_warps = kwargs.get("num_warps", 4)
        key = (kernel.__name__, json.dumps(signature, sort_keys=True), json.dumps(constexprs, sort_keys=True), num_warps)
        if key in seen:
            continue
        seen.add(key)
        compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs), target=target,
                                  options={"num_warps": num_warps})
        dtypes = sorted({t for t in signature.values() if t.startswith("*")})
        print(json.dumps(dict(kernel=kernel.__name__, constexprs=constexprs, num_warps=num_warps, pointers=dtypes,
                              **_resources(compiled.asm["cubin"]))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
