"""A kernel that compiles as it is and not as Inductor copies it: its helper reduces with a @jit
combine function bound to another module-level name, the pattern that made --torch-compile fail
on a GPU (NameError('_SUM_COMBINE is not defined') in _norm_fwd_kernel). The inductor-copy check
(sm90_compile --planted) must reject it."""

import triton
import triton.language as tl


@triton.jit
def _planted_combine(a, b):
    return a + b


_PLANTED_COMBINE = _planted_combine


@triton.jit
def _planted_sum(x):
    return tl.reduce(x, 0, _PLANTED_COMBINE)


@triton.jit
def _planted_kernel(X, Y, BLOCK: tl.constexpr):
    tl.store(Y, _planted_sum(tl.load(X + tl.arange(0, BLOCK))))
