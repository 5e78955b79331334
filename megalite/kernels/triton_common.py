"""Helpers shared by the Triton kernels. Imported only on the Triton path (imports triton).

Interpreter note (TRITON_INTERPRET=1, used by the CPU tests): the interpreter stores bf16 as raw
uint16 and converts fp32 -> bf16 by truncation, so arithmetic directly on bf16 values is wrong
and a plain ``.to(tl.bfloat16)`` rounds toward zero. The kernels therefore convert every load to
fp32 right away (``.to(tl.float32)``, an exact widening) and convert results with ``to_dtype``,
which rounds to nearest-even by hand under the interpreter and is a plain ``.to`` when compiled
(where fp32 -> bf16 is round-to-nearest-even already).
"""

import functools
import os
from typing import Callable

import torch
import triton
from torch._subclasses.fake_tensor import FakeTensor
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
    SM), at most one per block of rows; a handful under the interpreter."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(n_blocks, sms * max(1, 32 // num_warps)))
    return max(1, min(n_blocks, 4))


def compile_opaque(name: str, fake: Callable):
    """Make a kernel launcher opaque to torch.compile.

    Registers `fn` as the custom op megalite_kernels::<name> (with `fake` giving the outputs'
    shapes and dtypes) and returns a caller that goes through the op while torch.compile traces
    (Dynamo records one op instead of tracing into Triton's launcher) and on fake tensors
    (FakeTensorMode, a dry run on a fake CUDA device: the op's fake implementation answers); other
    eager calls skip the dispatcher and its overhead.
    """
    def wrap(fn):
        op = torch.library.custom_op(f"megalite_kernels::{name}", fn, mutates_args=())
        op.register_fake(fake)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            if torch.compiler.is_compiling() or any(isinstance(a, FakeTensor) for a in args):
                return op(*args, **kwargs)
            return fn(*args, **kwargs)
        return call
    return wrap
