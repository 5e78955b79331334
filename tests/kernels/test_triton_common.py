"""Interpreter detection across Triton versions: triton.knobs from Triton 3.4 on, the
TRITON_INTERPRET variable before (Triton 3.2 / 3.3, shipped with torch 2.6 / 2.7)."""

import os

import pytest
import triton

from megalite.kernels import triton_common


def test_detection_agrees_with_what_triton_jit_built():
    from triton.runtime.interpreter import InterpretedFunction

    assert triton_common.INTERPRETED == isinstance(triton_common.to_dtype, InterpretedFunction)
    assert triton_common.INTERPRETED == triton_common.interpreter_enabled()


@pytest.mark.parametrize("value, expected", [("1", True), ("0", False), (None, False), ("true", False)])
def test_triton_without_knobs_reads_the_environment_as_triton_3_3_does(monkeypatch, value, expected):
    """Triton 3.3's triton.jit: os.getenv("TRITON_INTERPRET", "0") == "1"."""
    monkeypatch.delattr(triton, "knobs", raising=False)
    if value is None:
        monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    else:
        monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_common.interpreter_enabled() is expected


def test_triton_with_knobs_follows_the_knob():
    if not hasattr(triton, "knobs"):
        pytest.skip("this Triton has no triton.knobs (before 3.4)")
    with triton.knobs.runtime.scope():  # restores the knobs and TRITON_INTERPRET afterwards
        os.environ["TRITON_INTERPRET"] = "yes"  # a value the knob takes and Triton 3.3 would not
        assert triton_common.interpreter_enabled() is True
        os.environ["TRITON_INTERPRET"] = "1"
        triton.knobs.runtime.interpret = False  # set in code: wins over the variable
        assert triton_common.interpreter_enabled() is False


def test_column_sums_over_several_chunks_of_partials(device):
    """launch_column_sums, the parameter-gradient sum of the norms' and bias-GeLU's backward, over
    more partial rows than one BLOCK_P chunk and more columns than one BLOCK_N block: each column
    within the bound on summing in the kernel's order, and a bf16 output is the fp32 sum rounded
    to nearest even (what the torch cast it replaces gave), for both sums of one launch."""
    import math

    import torch

    from tests.kernels.checks import assert_row_sum_close

    g = torch.Generator().manual_seed(5)
    parts, cols = 300, 200
    a_part = torch.randn(parts, cols, generator=g).to(device)
    b_part = (1e3 * torch.randn(parts, cols, generator=g)).to(device)
    launch = triton_common.column_sums_launch(parts, cols)
    col_blocks, block_p, block_n, _ = launch
    assert triton.cdiv(parts, block_p) > 1 and col_blocks > 1
    a32, b32 = (torch.empty(cols, device=device) for _ in range(2))
    triton_common.launch_column_sums(a_part, b_part, a32, b32, launch, triton_common.direct)
    depth = math.ceil(math.log2(block_p)) + triton.cdiv(parts, block_p)
    for got, part in ((a32, a_part), (b32, b_part)):
        terms = part.double().cpu()
        assert_row_sum_close(got.cpu(), terms.sum(0), terms, depth, "column sums")
    a16 = torch.empty(cols, dtype=torch.bfloat16, device=device)
    only_a = torch.empty(cols, device=device)
    triton_common.launch_column_sums(a_part, b_part, a16, b32.clone(), launch, triton_common.direct)
    triton_common.launch_column_sums(a_part, None, only_a, None, launch, triton_common.direct)
    assert torch.equal(a16, a32.to(torch.bfloat16)) and torch.equal(only_a, a32)
