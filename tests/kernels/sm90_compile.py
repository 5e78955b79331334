"""Compile every Triton kernel megalite launches, at realistic shapes, for an H100 (sm_90), on a
machine without a GPU, and report registers and spills.

    python -m tests.kernels.sm90_compile [--inductor] [--planted] [bfloat16] [float32]
    (TRITON_INTERPRET unset or 0)

The launch wrappers are called with tensors on the "meta" device while JITFunction.run is
replaced by a recorder, so the exact arguments, constexprs and num_warps the wrappers choose are
compiled (through Triton's full pipeline down to a cubin, with the ptxas bundled in the triton
wheel). Prints one JSON line per distinct compilation: kernel, constexprs, num_warps, registers,
spill bytes (stack), shared memory, and whether global loads and stores are 16 bytes wide
(vector_loads, vector_stores).

--inductor compiles each kernel a second time from the copy of its source torch.compile's
Inductor makes (inductor_copy.py), once per code path (constexprs other than block sizes), and
adds "inductor": "ok" or the error to that line, then prints {"op_kernels": ...}: the kernels
torch found in each triton_op (it hashes their source into its compile caches). The exit
status is 1 if any copy fails. --planted compiles tests/kernels/planted_kernels.py's kernel
instead of megalite's (its copy must fail).
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
SHAPES_BDA = [(8192, 2048)]  # one column-block width (1024) from h = 768 up
SHAPES_FP8 = [(16384, 4096)]  # flat: one tile whatever the shape


def _record_launches(dtypes):
    """Call every launch wrapper on meta tensors of `dtypes`; return the recorded (kernel, args, kwargs)."""
    from torch._library.triton import set_wrap_triton_enabled
    from triton.runtime.jit import JITFunction

    from megalite.kernels import (activations_triton, bias_dropout_add_triton, cross_entropy_triton, fp8_cast_triton,
                                  norms_triton, rotary_triton)

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
                for rows, h in SHAPES_BDA:
                    x = torch.empty(rows, h, dtype=dtype, **meta)
                    b = torch.empty(h, dtype=dtype, **meta)
                    seed = torch.empty(1, dtype=torch.int64, **meta)
                    for bias, p in ((b, 0.0), (b, 0.1), (None, 0.1)):  # no bias, no dropout: one torch add
                        bias_dropout_add_triton.bias_dropout_add_forward(x, bias, x, seed if p else None, p)
                        if p:
                            bias_dropout_add_triton.bias_dropout_add_backward(x, seed, p, bias is not None)
                for rows, h in SHAPES_FP8:
                    x = torch.empty(rows, h, dtype=dtype, **meta)
                    scalar = torch.empty((), dtype=torch.float32, **meta)
                    fp8_cast_triton.fp8_amax_op(x)
                    for fp8, record in ((torch.float8_e4m3fn, True), (torch.float8_e4m3fn, False),
                                        (torch.float8_e5m2, True)):
                        fp8_cast_triton.fp8_cast_op(x, scalar, scalar, fp8, record)
                    for fp8, record in ((torch.float8_e5m2, True), (torch.float8_e4m3fn, False)):  # wgrad's dy, x
                        fp8_cast_triton.fp8_cast_transposed_op(x, scalar, scalar, fp8, record)
                    # dy for dgrad and wgrad (delayed: recording; tensorwise: after the amax pass), the weight
                    for fp8, record in ((torch.float8_e5m2, True), (torch.float8_e4m3fn, False)):
                        fp8_cast_triton.fp8_cast_transpose_op(x, scalar, scalar, fp8, record)
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
    """(signature, constexprs, attrs) as JITFunction.run specialises the launch: bools, Nones and
    keyword (constexpr) arguments fixed, and pointers whose address and integers whose value are
    multiples of 16 marked divisible by 16 (tt.divisibility), which lets Triton vectorise loads."""
    names = kernel.arg_names
    values = dict(zip(names, args)) | {k: v for k, v in kwargs.items() if k in names}
    pointer = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int64: "*i64",
               torch.float8_e4m3fn: "*fp8e4nv", torch.float8_e5m2: "*fp8e5"}
    signature, constexprs, attrs = {}, {}, {}
    for index, name in enumerate(names):
        value = values[name]
        if value is None or isinstance(value, bool) or name in kwargs:
            signature[name], constexprs[name] = "constexpr", value
            continue
        if isinstance(value, torch.Tensor):
            signature[name] = pointer[value.dtype]
            divisible = value.data_ptr() % 16 == 0
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
            divisible = value % 16 == 0
        elif isinstance(value, float):
            signature[name], divisible = "fp32", False
        else:
            raise TypeError(f"{kernel.__name__}: cannot type argument {name}={value!r}")
        if divisible:
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, constexprs, attrs


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


def _planted_launch():
    from tests.kernels import planted_kernels

    x = torch.empty(64, dtype=torch.float32, device="meta")
    return [(planted_kernels._planted_kernel, (x, x), {"BLOCK": 64})]


def main(argv: list[str]) -> int:
    """argv: --inductor, --planted, dtype names (default: bfloat16 float32)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("sm90_compile: unset TRITON_INTERPRET (kernels must be compiled, not interpreted)", file=sys.stderr)
        return 2
    flags = {a for a in argv if a.startswith("--")}
    dtypes = [getattr(torch, name) for name in ([a for a in argv if a not in flags] or ["bfloat16", "float32"])]
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tests.kernels.inductor_copy import inductor_copy, names_inductor_drops

    target = GPUTarget("cuda", 90, 32)
    seen, copied, failed = set(), set(), False
    launches = _planted_launch() if "--planted" in flags else _record_launches(dtypes)
    with tempfile.TemporaryDirectory() as copies:
        for kernel, args, kwargs in launches:
            signature, constexprs, attrs = _signature(kernel, args, kwargs)
            num_warps = kwargs.get("num_warps", 4)
            key = (kernel.__name__, json.dumps(signature, sort_keys=True), json.dumps(constexprs, sort_keys=True),
                   num_warps)
            if key in seen:
                continue
            seen.add(key)
            options = {"num_warps": num_warps}
            compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs, attrs=attrs),
                                      target=target, options=options)
            pointers = sorted({t for t in signature.values() if t.startswith("*")})
            line = dict(kernel=kernel.__name__, constexprs=constexprs, num_warps=num_warps, pointers=pointers,
                        **_resources(compiled.asm["cubin"]),
                        vector_loads="ld.global.v4" in compiled.asm["ptx"],  # 16-byte loads
                        vector_stores="st.global.v4" in compiled.asm["ptx"])  # 16-byte stores
            path = (kernel.__name__, json.dumps(signature, sort_keys=True),
                    json.dumps({k: v for k, v in constexprs.items() if not k.startswith("BLOCK")}, sort_keys=True))
            if "--inductor" in flags and path not in copied:
                copied.add(path)
                try:
                    copy = inductor_copy(kernel, copies)
                    triton.compile(ASTSource(fn=copy, signature=signature, constexprs=constexprs, attrs=attrs),
                                   target=target, options=options)
                    line["inductor"] = "ok"
                except Exception as error:  # noqa: BLE001 - reported, and the exit status says so
                    failed = True
                    chain = [error]
                    while chain[-1].__cause__ is not None or chain[-1].__context__ is not None:
                        chain.append(chain[-1].__cause__ or chain[-1].__context__)
                    line["inductor"] = " <- ".join(f"{type(e).__name__}: {str(e).splitlines()[-1] if str(e) else ''}"
                                                   for e in reversed(chain))[:500]
                line["inductor_drops"] = names_inductor_drops(kernel)
                failed |= bool(line["inductor_drops"])
            print(json.dumps(line), flush=True)
    if "--inductor" in flags and "--planted" not in flags:
        from torch._library.custom_ops import OPDEFS
        from torch._library.triton import get_triton_kernels_for_op

        print(json.dumps({"op_kernels": {name: sorted(k.__name__ for k in get_triton_kernels_for_op(name))
                                         for name in OPDEFS if name.startswith("megalite_kernels::")}}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
