"""Helpers shared by the Triton kernels. Imported only on the Triton path (imports triton).

Interpreter note (TRITON_INTERPRET=1, used by the CPU tests): the interpreter stores bf16 as raw
uint16 and converts fp32 -> bf16 by truncation, so arithmetic directly on bf16 values is wrong
and a plain ``.to(tl.bfloat16)`` rounds toward zero. The kernels therefore convert every load to
fp32 right away (``.to(tl.float32)``, an exact widening) and convert results with ``to_dtype``,
which rounds to nearest-even by hand under the interpreter and is a plain ``.to`` when compiled
(where fp32 -> bf16 is round-to-nearest-even already).
"""

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
        else:
            return x.to(dtype)
else:
    @triton.jit
    def to_dtype(x, dtype: tl.constexpr):
        """Round fp32 `x` to `dtype` (round to nearest even)."""
        return x.to(dtype)


# Reductions and sigmoid written on Triton builtins only. triton.language's own tl.sum, tl.max,
# tl.sigmoid, tl.zeros and tl.cdiv are @jit functions decorated when triton.language is first
# imported: if anything in the process (megatron.core, torch._dynamo) imported it before
# TRITON_INTERPRET=1 was set, they are compiled-mode functions the interpreter cannot call. Ours
# are decorated lazily with megalite's kernels, so the CPU tests work in a shared process.
#
# The combine functions are tl.sum's and tl.max's own (compiled, tl.reduce with them is exactly
# tl.sum / tl.max): the interpreter recognises them and reduces with numpy, where any other
# combine function is applied element by element in Python, hundreds of times slower. The
# interpreter never runs them as kernels (at most their plain Python body), so it does not
# matter in which mode triton.language decorated them. Ours stand in if a Triton lacks them.
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


@triton.jit
def sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


def rows_per_program(n_cols_block: int, n_rows: int, target_elems: int = 4096) -> int:
    """Rows handled by one program so that a tile holds about `target_elems` elements."""
    return max(1, min(target_elems // n_cols_block, triton.next_power_of_2(max(n_rows, 1))))


def warps_for(tile_elems: int, elems_per_thread: int = 16) -> int:
    """num_warps for a memory-bound tile holding about `elems_per_thread` fp32 values per thread
    (1 to 32 warps). Kernels that keep more live arrays per element ask for fewer per thread so
    that they stay under the register limit (checked by compiling for sm_90 in the tests)."""
    return max(1, min(32, tile_elems // (32 * elems_per_thread)))


def persistent_programs(device: torch.device, n_blocks: int, num_warps: int) -> int:
    """Programs for a loop-over-rows kernel: as many as fit on the GPU at once (about 32 warps per
    SM), at most one per block of rows; a handful under the interpreter. On a fake CUDA device (a
    dry run) the SM count is the modelled GPU's, which the dry run answers through the same call."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_blocks, sms * max(1, 32 // num_warps)))
    return max(1, min(n_blocks, 4))


_TRITON_OP = getattr(torch.library, "triton_op", None)
wrap_triton = getattr(torch.library, "wrap_triton", None) or (lambda kernel: kernel)
"""torch.library.wrap_triton: a kernel launched through it inside a triton_op is a node torch.compile
and FakeTensorMode see (a no-op on fake tensors); an interpreted kernel it returns as it is."""


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
