"""Helpers shared by the Triton kernels. Imported only on the Triton path (imports triton).

Interpreter note (TRITON_INTERPRET=1, used by the CPU tests): the interpreter stores bf16 as raw
uint16 and converts fp32 -> bf16 by truncation, so arithmetic directly on bf16 values is wrong
and a plain ``.to(tl.bfloat16)`` rounds toward zero. The kernels therefore convert every load to
fp32 right away (``.to(tl.float32)``, an exact widening) and convert results with ``to_dtype``,
which rounds to nearest-even by hand under the interpreter and is a plain ``.to`` when compiled
(where fp32 -> bf16 is round-to-nearest-even already).

Inductor note (torch.compile): Inductor compiles a kernel launched inside a triton_op from a
copy of its source, with the source of every @jit function it calls pasted beside it under the
name it is called by, plus module-level int/str/bool/constexpr values; nothing else of the
module comes along (torch._inductor.codegen.wrapper.user_defined_triton_kernel_transitive_closure_source_code).
So a compiled-mode kernel or helper may refer only to `tl`, builtins, and @jit functions by their
own names; tests/kernels/test_compile_sm90.py compiles every kernel from that copy.
"""

import functools
import os
from typing import Callable

import torch
import triton
import triton.language as tl


def interpreter_enabled() -> bool:
    """Whether triton.jit builds interpreted kernels in this process, read as this Triton reads
    it: through triton.knobs from Triton 3.4 on (TRITON_INTERPRET = 1, true, on or yes); Triton
    3.2 and 3.3 (those of torch 2.6 and 2.7) have no knobs and take only TRITON_INTERPRET=1."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


INTERPRETED = interpreter_enabled()

if INTERPRETED:
    @triton.jit
    def to_dtype(x, dtype: tl.constexpr):
        """Round fp32 `x` to `dtype` (round to nearest even)."""
        if dtype == tl.bfloat16:
            bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
            bits = bits + (((bits >> 16) & 1) + 0x7FFF)
            return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
        elif dtype == tl.float8e4nv:
            return _to_fp8(x, 3, 7, 0x7E, 0x7E).to(tl.float8e4nv, bitcast=True)
        elif dtype == tl.float8e5:
            return _to_fp8(x, 2, 15, 0x7B, 0x7C).to(tl.float8e5, bitcast=True)
        else:
            return x.to(dtype)

    @triton.jit
    def _to_fp8(x, MANT: tl.constexpr, BIAS: tl.constexpr, MAX_CODE: tl.constexpr, OVERFLOW_CODE: tl.constexpr):
        """The byte of fp32 `x` rounded to nearest even in an FP8 format with MANT mantissa bits
        and exponent bias BIAS, as torch's conversion: magnitudes past the largest finite code
        MAX_CODE become OVERFLOW_CODE (e4m3fn saturates at 448, infinities included; e5m2
        overflows to infinity), NaN becomes 0x7F, the sign is kept. The interpreter's own
        conversion rounds wrongly where rounding carries into the next binade."""
        bits = x.to(tl.float32).to(tl.uint32, bitcast=True)
        sign = (bits >> 24) & 0x80
        mag = bits & 0x7FFFFFFF
        # below the smallest normal 2**(1 - BIAS): a multiple of 2**(1 - BIAS - MANT), rounded to
        # an integer by fp32 arithmetic itself (adding 2**23 keeps no fraction bits; exact scaling)
        is_sub = mag < ((128 - BIAS) << 23)
        scaled = tl.where(is_sub, mag, 0).to(tl.float32, bitcast=True) * (2.0 ** (BIAS - 1 + MANT))
        sub = ((scaled + 8388608.0) - 8388608.0).to(tl.uint32)
        # normal: drop 23 - MANT mantissa bits, rounding half to even (a carry moves up a binade),
        # then rebias the exponent; the codes are contiguous, so subnormals' top code is 1.0 * min normal
        shift: tl.constexpr = 23 - MANT
        normal = ((mag + ((1 << (shift - 1)) - 1) + ((mag >> shift) & 1)) >> shift) - ((127 - BIAS) << MANT)
        code = tl.where(is_sub, sub, normal)
        code = tl.where(mag > 0x7F800000, 0x7F, tl.where((mag >= 0x7F800000) | (code > MAX_CODE), OVERFLOW_CODE, code))
        return (sign | code).to(tl.uint8)

    # Under the interpreter, reductions are written on Triton builtins only. triton.language's own
    # tl.sum and tl.max are @jit functions decorated when triton.language is first imported: if
    # anything in the process (megatron.core, torch._dynamo) imported it before TRITON_INTERPRET=1
    # was set, they are compiled-mode functions the interpreter cannot call. The combine
    # functions are tl.sum's and tl.max's own: the interpreter recognises them and reduces with
    # numpy (any other combine function it applies element by element, hundreds of times
    # slower), and never runs them as kernels, so the mode they were decorated in does not matter.
    @triton.jit
    def _add(a, b):
        return a + b

    @triton.jit
    def _maximum(a, b):
        return tl.maximum(a, b)

    _SUM_COMBINE = getattr(tl.standard, "_sum_combine", None) or _add
    _MAX_COMBINE = getattr(tl.standard, "_elementwise_max", None) or _maximum

    @triton.jit
    def reduce_sum(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _SUM_COMBINE)

    @triton.jit
    def reduce_max(x, axis: tl.constexpr):
        return tl.reduce(x, axis, _MAX_COMBINE)
else:
    @triton.jit
    def to_dtype(x, dtype: tl.constexpr):
        """Round fp32 `x` to `dtype` (round to nearest even)."""
        return x.to(dtype)

    # Compiled: tl.sum / tl.max themselves (the interpreter's combine functions above are the
    # same tl.reduce), referred to through `tl`, which Inductor's copy of the source imports.
    @triton.jit
    def reduce_sum(x, axis: tl.constexpr):
        return tl.sum(x, axis)

    @triton.jit
    def reduce_max(x, axis: tl.constexpr):
        return tl.max(x, axis)


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _column_sums_kernel(A_PART, B_PART, A, B, n_parts, n_cols,
                        HAS_B: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """A (and B) [n_cols]: the column sums of the fp32 partials A_PART (B_PART) [n_parts, n_cols]
    (contiguous), BLOCK_P rows at a time, rounded once to A's (B's) dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < n_cols
    a = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
    b = tl.full([BLOCK_N], 0.0, dtype=tl.float32)
    for start in range(0, n_parts, BLOCK_P):
        parts = start + tl.arange(0, BLOCK_P)
        mask = (parts < n_parts)[:, None] & col_ok[None, :]
        offsets = parts[:, None].to(tl.int64) * n_cols + cols[None, :]
        a += reduce_sum(tl.load(A_PART + offsets, mask=mask, other=0.0), axis=0)
        if HAS_B:
            b += reduce_sum(tl.load(B_PART + offsets, mask=mask, other=0.0), axis=0)
    tl.store(A + cols, to_dtype(a, A.dtype.element_ty), mask=col_ok)
    if HAS_B:
        tl.store(B + cols, to_dtype(b, B.dtype.element_ty), mask=col_ok)


def column_sums_launch(n_parts: int, n_cols: int) -> tuple[int, int, int, int]:
    """(column blocks, BLOCK_P, BLOCK_N, num_warps) of _column_sums_kernel: tiles of about 4096
    partials, at most 128 columns wide, 16 values of each sum's tile per thread."""
    block_n = min(128, triton.next_power_of_2(n_cols))
    block_p = max(1, min(triton.next_power_of_2(n_parts), 4096 // block_n))
    return cdiv(n_cols, block_n), block_p, block_n, warps_for(block_p * block_n, 16)


cached_column_sums_launch = functools.lru_cache(maxsize=256)(column_sums_launch)


def launch_column_sums(a_part, b_part, a, b, launch, wrap_triton) -> None:
    """a (b) [h] = the sums over rows of the fp32 partials a_part (b_part) [parts, h], in a's (b's)
    dtype: the parameter gradients of the kernels that leave per-program partial sums, in one
    launch instead of a torch sum and cast each. b_part and b None for one sum."""
    n_parts, n_cols = a_part.shape
    col_blocks, block_p, block_n, num_warps = launch
    wrap_triton(_column_sums_kernel)[(col_blocks,)](
        a_part, b_part, a, b, n_parts, n_cols, HAS_B=b_part is not None, BLOCK_P=block_p, BLOCK_N=block_n,
        num_warps=num_warps)


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (and SymInts): triton.cdiv's arithmetic without its per-call overhead."""
    return -(-a // b)


def rows_per_program(n_cols_block: int, n_rows: int, target_elems: int = 4096) -> int:
    """Rows handled by one program so that a tile holds about `target_elems` elements."""
    return max(1, min(target_elems // n_cols_block, triton.next_power_of_2(max(n_rows, 1))))


def warps_for(tile_elems: int, elems_per_thread: int = 16) -> int:
    """num_warps for a memory-bound tile holding about `elems_per_thread` fp32 values per thread
    (1 to 32 warps). Kernels that keep more live arrays per element ask for fewer per thread so
    that they stay under the register limit (checked by compiling for sm_90 in the tests)."""
    return max(1, min(32, tile_elems // (32 * elems_per_thread)))


def sm_count(device: torch.device) -> int | None:
    """Streaming multiprocessors of a CUDA device, asked now (a dry run's fake CUDA device answers
    its modelled GPU's through the same call); None for the CPU (the interpreter)."""
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return None


@functools.lru_cache(maxsize=None)
def _cached_sm_count(device_type: str, index: int | None) -> int | None:
    return sm_count(torch.device(device_type, index))


def cached_sm_count(device: torch.device) -> int | None:
    """sm_count, asked once per device: the eager path's per-call lookup."""
    return _cached_sm_count(device.type, device.index)


def persistent_programs(n_blocks: int, num_warps: int, sms: int | None) -> int:
    """Programs for a loop-over-rows kernel: as many as fit on the GPU at once (32 warps per SM,
    which the sm_90 compile test checks the registers allow), at most one per block of rows; a
    handful on the CPU (sms None)."""
    if sms is None:
        return max(1, min(n_blocks, 4))
    return max(1, min(n_blocks, sms * max(1, 32 // num_warps)))


class DirectLauncher:
    """`kernel[grid](*args, **constexprs)` for the eager path, with less host time than
    JITFunction.run: its first launch at each specialisation goes through JITFunction.run (which
    compiles, launches and returns the CompiledKernel); later launches with the same
    specialisation launch that CompiledKernel directly, skipping run()'s option parsing, argument
    binding and cache-key building: through its launcher (CompiledKernel.run, as CompiledKernel[grid]
    calls it, without building that runner closure and the launch metadata each call) when no
    Triton launch hook is set, through CompiledKernel[grid] when a profiler has set one.

    The key holds all that Triton specialises a launch on, or more: the current device (whose
    kernel cache run() uses), the constexpr and option keywords, each tensor's dtype and whether
    its address is a multiple of 16, for each int whether it is 1 (Triton makes that a constant),
    a multiple of 16, or wider than 32 bits, and Nones and floats by kind. Anything else among the
    arguments (a bool passed positionally, a tensor subclass), or pre-run hooks on the kernel, and
    the launch goes through run(). Triton 3.3 and later pass every argument, constexprs included,
    to the compiled launcher, as here; before 3.4 (no triton.knobs) the eager path launches
    through JITFunction.run (`direct` returns the kernel itself)."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.names = kernel.arg_names
        self.compiled = {}

    def __getitem__(self, grid):
        return functools.partial(self.launch, grid)

    def launch(self, grid, *args, **kwargs):
        device = _driver.active.get_current_device()
        key = [device, *kwargs.values()]
        append = key.append
        for a in args:
            kind = a.__class__
            if kind is _TENSOR or kind is _PARAMETER:
                append(a.dtype)
                append((a.data_ptr() & 15) == 0)
            elif kind is int:
                append(1 if a == 1 else (a & 15) == 0 if -2**31 <= a < 2**31 else ((a & 15) == 0, a >= 2**63))
            elif a is None:
                append(None)
            elif kind is float:
                append(float)
            else:  # a bool passed positionally, a tensor subclass: Triton's own launch path
                return self.kernel[grid](*args, **kwargs)
        key = tuple(key)
        found = self.compiled.get(key)
        if found is None or getattr(self.kernel, "pre_run_hooks", None):
            compiled = self.kernel[grid](*args, **kwargs)
            if isinstance(compiled, CompiledKernel):
                self.compiled[key] = (compiled, tuple(kwargs[name] for name in self.names[len(args):]))
            return
        compiled, constexprs = found
        grid = (*grid, 1, 1)
        enter, leave = _RUNTIME.launch_enter_hook, _RUNTIME.launch_exit_hook
        if _hook_set(enter) or _hook_set(leave):  # a profiler's hooks want the launch metadata: Triton's runner
            compiled[grid[:3]](*args, *constexprs)
            return
        # What CompiledKernel[grid](*args) does with no launch hooks, without building its runner
        # closure and launch metadata every call.
        compiled.run(grid[0], grid[1], grid[2], _driver.active.get_current_stream(device), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *constexprs)


def _hook_set(hook) -> bool:
    """Whether a Triton launch hook would do anything: not None and, for Triton 3.5+'s HookChain, not empty."""
    return hook is not None and bool(getattr(hook, "calls", True))


_TENSOR, _PARAMETER = torch.Tensor, torch.nn.Parameter


if INTERPRETED or not hasattr(triton, "knobs"):
    def direct(kernel):
        """The eager path's stand-in for torch.library.wrap_triton: the kernel itself."""
        return kernel
else:
    from triton.compiler import CompiledKernel
    from triton.runtime.driver import driver as _driver

    _RUNTIME = triton.knobs.runtime

    _LAUNCHERS: dict[int, DirectLauncher] = {}

    def direct(kernel):
        """The eager path's stand-in for torch.library.wrap_triton: the kernel's DirectLauncher
        (one a kernel, kept for the process like the kernel itself)."""
        launcher = _LAUNCHERS.get(id(kernel))
        if launcher is None:
            launcher = _LAUNCHERS[id(kernel)] = DirectLauncher(kernel)
        return launcher


_TRITON_OP = getattr(torch.library, "triton_op", None)
op_wrap_triton = direct if INTERPRETED else (getattr(torch.library, "wrap_triton", None) or direct)
"""How the operators launch: torch.library.wrap_triton for compiled kernels (a kernel launched
through it inside a triton_op is a node torch.compile and FakeTensorMode see, and a no-op on fake
tensors); interpreted kernels directly (torch before 2.13 rejects them in wrap_triton)."""


_PLAIN = (torch.Tensor, torch.nn.Parameter)


def eager_path(*tensors: torch.Tensor | None) -> bool | None:
    """Whether an op takes its eager path (megalite's autograd.Function launching the kernels
    directly) instead of its operator, and with autograd: None for the operator (inside
    torch.compile, under a dispatch mode such as FakeTensorMode, a dry run, opcheck or selective
    checkpointing, or for tensor subclasses, all of which must see the operator); else True when
    autograd must record the op (grad mode on and an input requiring grad), False when not."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack() > 0:
        return None
    grad = False
    for t in tensors:
        if t is not None:
            if type(t) not in _PLAIN:
                return None
            grad = grad or t.requires_grad
    return grad and torch.is_grad_enabled()


def apply(function: type, raw_apply: Callable, *args):
    """function.apply(*args), through `raw_apply` (super(torch.autograd.Function, function).apply,
    the C++ entry) unless a functorch transform (vmap, grad) is active: Function.apply's Python
    wrapper adds about 2 us a call to bind arguments and unwrap functorch wrappers, needed only there."""
    if torch._C._are_functorch_transforms_active():
        return function.apply(*args)
    return raw_apply(*args)


def kernel_op(name: str, fake: Callable, mutates_args: tuple[str, ...] = ()):
    """Register the launcher `fn` as the PyTorch operator megalite_kernels::<name> and return it.

    Compiled Triton on a torch with torch.library.triton_op: a triton_op whose kernels are launched
    through wrap_triton, so torch.compile traces through it (Inductor sees the kernels) and its
    fake implementation is `fn` itself, allocations as on the GPU and launches that do nothing.
    Under Triton's interpreter (whose kernels wrap_triton cannot trace) or without triton_op: an
    opaque torch.library.custom_op with `fake` (outputs' shapes, dtypes, strides) as its fake
    implementation. Either way the op runs under FakeTensorMode and inside torch.compile;
    autograd is registered on it with torch.library.register_autograd where it has a gradient.
    """
    def wrap(fn):
        qualified = f"megalite_kernels::{name}"
        if _TRITON_OP is not None and not INTERPRETED:
            return _TRITON_OP(qualified, fn, mutates_args=mutates_args)
        op = torch.library.custom_op(qualified, fn, mutates_args=mutates_args)
        op.register_fake(fake)
        return op
    return wrap
