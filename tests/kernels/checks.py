"""Tolerances and comparison helpers shared by the kernel tests.

Inputs are of unit scale (randn-like), so absolute tolerances are meaningful.

- fp32, kernel vs reference: rtol 1e-5, atol 1e-5.
- bf16 forward, kernel vs the bf16 reference: both compute in fp32 and round to bf16 once, so
  they may differ by one bf16 ulp where the fp32 results straddle a rounding boundary:
  rtol 2^-7 (one ulp relative to the value), atol 1e-5. RMSNorm rounds twice by definition
  (normalised row, then the product with the weight): a one-ulp flip in the first rounding,
  scaled by the weight, can cross into a smaller binade, so it gets two ulps, rtol 2^-6.
- bf16 backward, kernel vs fp64 autograd through the reference at the same bf16-valued
  inputs: the kernel rounds each gradient once (half an ulp, 2^-8 relative), and RMSNorm's
  dweight sees its normalised row rounded to bf16 by definition: rtol 2^-7 plus
  atol 2^-7 * max|expected| (one ulp of the largest entry, for reductions whose terms cancel),
  and never below the fp32 atol 1e-5. Gradients of fp32 parameters used with bf16 activations
  get these bf16 tolerances too: their precision is set by the bf16 activations.
- fp32 sums over many rows (dweight, dbias of a backward over thousands of rows): the kernel adds
  the rows' terms in another order than fp64 autograd; the tolerance is the bound on that
  (assert_row_sum_close), not a looser constant.
"""

import math

import torch
import triton

BF16_ULP = 2.0 ** -7  # spacing of bf16 numbers in [1, 2)

# The row kernels' edge shapes (rows, width): every row count (one row, a partial block of rows)
# and every width (one column, under a vector, a partial column block, past a power of two)
# appears, rows 1 and 17 with both extreme widths. Not their cross product: each shape is a
# compilation of each kernel on a GPU (its tile sizes and num_warps are constexprs), and the
# cross product's 12 shapes made the CUDA tests compile 462 kernels (tests/kernels/compile_count.py).
EDGE_SHAPES = [(1, 7), (1, 130), (3, 1), (3, 33), (17, 1), (17, 130)]

FP32_TOL = dict(rtol=1e-5, atol=1e-5)
BF16_FWD_TOL = dict(rtol=BF16_ULP, atol=1e-5)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, *, rtol: float, atol: float, name: str) -> None:
    torch.testing.assert_close(actual.detach().double(), expected.detach().double(), rtol=rtol, atol=atol,
                               msg=lambda m: f"{name}: {m}")


def assert_forward_close(actual: torch.Tensor, expected: torch.Tensor, name: str, *, bf16_ulps: int = 1) -> None:
    """Kernel output vs the reference output at the same dtype."""
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype}, expected {expected.dtype}"
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    tol = FP32_TOL if actual.dtype == torch.float32 else dict(BF16_FWD_TOL, rtol=bf16_ulps * BF16_ULP)
    assert_close(actual, expected, name=name, **tol)


def assert_grad_close(actual: torch.Tensor, expected64: torch.Tensor, dtype: torch.dtype, name: str, *,
                      activation_dtype: torch.dtype | None = None) -> None:
    """Kernel gradient (in `dtype`) vs the fp64 gradient of the reference; the tolerance follows
    the activations' dtype (default `dtype`)."""
    assert actual.dtype == dtype, f"{name}: grad dtype {actual.dtype}, expected {dtype}"
    assert actual.shape == expected64.shape, f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected64.shape)}"
    if (activation_dtype or dtype) == torch.float32:
        tol = FP32_TOL
    else:
        tol = dict(rtol=BF16_ULP, atol=max(FP32_TOL["atol"], BF16_ULP * float(expected64.abs().max())))
    assert_close(actual, expected64, name=name, **tol)


FP32_UNIT_ROUNDOFF = 2.0 ** -24


def summation_depth(block_m: int, n_blocks: int, programs: int) -> int:
    """The most additions one row's term goes through in a backward kernel's sum over rows: a tree
    over the BLOCK_M rows of a block (ceil(log2 BLOCK_M) levels), the program's running sum over
    its row blocks (one per block), then the sum over the programs' partials
    (triton_common.launch_column_sums: at most programs - 1 additions, the longest any order can take)."""
    return math.ceil(math.log2(block_m)) + triton.cdiv(n_blocks, programs) + programs - 1


def assert_row_sum_close(actual: torch.Tensor, expected64: torch.Tensor, terms64: torch.Tensor, depth: int,
                         name: str) -> None:
    """`actual` [h]: a kernel's fp32 sum over rows of its terms, given in fp64 as `terms64` [n, h]
    (the kernel's own fp32 values, or recomputed from its saved statistics, whose roundings the
    caller adds to `depth`); `expected64` [h]: the exact (fp64 reference) sum.

    Any order of adding the terms in which each passes through at most d additions errs by at
    most gamma_d * sum|t_i|, gamma_d = d u / (1 - d u), u = 2^-24 (Higham, Accuracy and Stability
    of Numerical Algorithms, 2nd ed., sec. 4.2: the computed sum is sum t_i (1 + theta_i),
    |theta_i| <= gamma_d). So |actual - expected| <= |sum t_i - expected| (the terms' own error,
    checked elementwise where they are outputs) + gamma_d * sum|t_i|, column by column."""
    assert actual.dtype == torch.float32 and actual.shape == expected64.shape, f"{name}: {actual.dtype} {actual.shape}"
    d = depth * FP32_UNIT_ROUNDOFF
    allowed = (terms64.sum(0) - expected64).abs() + d / (1 - d) * terms64.abs().sum(0)
    error = (actual.double() - expected64).abs()
    worst = int((error - allowed).argmax())
    assert bool((error <= allowed).all()), (f"{name}: column {worst} off by {float(error[worst]):.3g}, bound "
                                            f"{float(allowed[worst]):.3g} (depth {depth})")


def assert_partial_sums_close(partials: torch.Tensor, terms64: torch.Tensor, block_m: int, depth: int,
                              name: str) -> None:
    """partials [P, h]: the fp32 sums a persistent backward kernel's programs wrote, program p
    having added the rows of blocks p, p + P, p + 2P, ... (BLOCK_M rows a block); terms64 [n, h]:
    the kernel's terms in fp64. Each program's sum is held to gamma_d * sum|t| over its own rows
    (the bound of assert_row_sum_close), d = `depth` (its tree over a block, its blocks, the
    terms' own roundings): a row dropped or counted twice fails it at any grid size, where the
    bound on torch's final sum over thousands of partials would not."""
    programs = partials.shape[0]
    owner = (torch.arange(terms64.shape[0]) // block_m) % programs
    expected = torch.zeros(partials.shape, dtype=torch.float64).index_add_(0, owner, terms64)
    magnitude = torch.zeros(partials.shape, dtype=torch.float64).index_add_(0, owner, terms64.abs())
    d = depth * FP32_UNIT_ROUNDOFF
    error = (partials.double().cpu() - expected).abs()
    allowed = d / (1 - d) * magnitude
    worst = divmod(int((error - allowed).argmax()), partials.shape[1])
    assert bool((error <= allowed).all()), (f"{name}: program {worst[0]} column {worst[1]} off by "
                                            f"{float(error[worst]):.3g}, bound {float(allowed[worst]):.3g}")


def grads_fp64(fn, inputs: list[torch.Tensor | None], grad_out: torch.Tensor) -> list[torch.Tensor | None]:
    """Gradients of fn(*inputs) w.r.t. the non-None inputs, evaluated in fp64 at the same values."""
    leaves = [None if t is None else t.detach().double().requires_grad_() for t in inputs]
    out = fn(*leaves)
    present = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(out, present, grad_out.double()))
    return [None if t is None else next(grads) for t in leaves]


def rows_with_several_blocks_per_program(launch) -> int:
    """A row count (37, 75, 151, ...: odd, so the last row block is partial) at which a backward
    kernel's programs loop over more than one row block: `launch(n_rows)` returns the launcher's
    (programs, BLOCK_M). The cap on programs is the device's (a few under the interpreter,
    a few per SM on a GPU), so the count is found rather than fixed."""
    rows = 37
    while True:
        programs, block_m = launch(rows)
        if triton.cdiv(rows, block_m) > programs:
            return rows
        rows = 2 * rows + 1
