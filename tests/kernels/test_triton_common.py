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
