"""FP8 GEMMs of a linear layer (--fp8-format; megalite/parallel/tensor/fp8_gemm.py and
fp8_scaling.py) against plain-torch references that quantize with the same scales:
x * scale, saturated, cast to float8, upcast, divided by the scale, multiplied in fp32.

Delayed scaling's history and scales are checked step by step against Transformer Engine's
formula written out independently: after step k, scale = fp8_max / amax / 2**margin with amax
the step's own (most_recent) or the max of the last history_len steps' (max); scale 1 before
the first update; a zero amax keeps the previous scale.
"""

import pytest
import torch

from megalite.parallel.tensor import fp8_gemm
from megalite.parallel.tensor.fp8_gemm import Fp8Gemm
from megalite.parallel.tensor.fp8_scaling import (GRAD, INPUT, WEIGHT, DelayedScaling, DelayedScalingStates,
                                                  Fp8Recipe, TensorwiseScaling)
from megalite.parallel.tensor.linear_function import tensor_parallel_linear

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2
MAX = {E4M3: 448.0, E5M2: 57344.0}


def _dequantized(t: torch.Tensor, scale: float, dtype) -> torch.Tensor:
    """The reference quantizer: plain torch, the scale given as a number."""
    return (t.double() * scale).clamp(-MAX[dtype], MAX[dtype]).float().to(dtype).double() / scale


def _current_scale(t: torch.Tensor, dtype) -> float:
    return MAX[dtype] / float(t.abs().max())


def _operands(seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, 5, 48, generator=g) * 3
    w = torch.randn(32, 48, generator=g) * 0.05
    b = torch.randn(32, generator=g)
    dy = torch.randn(3, 5, 32, generator=g) * 1e-3
    return x, w, b, dy


def _fp8_linear(recipe, x, w, b, dy, gemm=None):
    """Output and gradients of a column linear through `gemm` (default: tensorwise Fp8Gemm)."""
    x, w, b = (t.clone().requires_grad_() for t in (x, w, b))
    y = tensor_parallel_linear(x, w, b, gemm or Fp8Gemm(recipe, TensorwiseScaling(recipe), "column"))
    y.backward(dy)
    return y.detach(), x.grad, w.grad, b.grad


@pytest.mark.parametrize("fmt", ["e4m3", "hybrid"])
def test_tensorwise_forward_and_backward_equal_the_quantized_reference(fmt):
    x, w, b, dy = _operands()
    grad_dtype = E5M2 if fmt == "hybrid" else E4M3
    y, dx, dw, db = _fp8_linear(Fp8Recipe(format=fmt, scaling="tensorwise"), x, w, b, dy)
    xq = _dequantized(x, _current_scale(x, E4M3), E4M3).reshape(-1, 48)
    wq = _dequantized(w, _current_scale(w, E4M3), E4M3)
    gq = _dequantized(dy, _current_scale(dy, grad_dtype), grad_dtype).reshape(-1, 32)
    assert torch.allclose(y.reshape(-1, 32).double(), xq @ wq.t() + b.double(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(dx.reshape(-1, 48).double(), gq @ wq, rtol=1e-5, atol=1e-9)
    assert torch.allclose(dw.double(), gq.t() @ xq, rtol=1e-5, atol=1e-9)
    assert torch.equal(db, dy.reshape(-1, 32).sum(0))
    # and FP8 really ran: the unquantized product differs by far more than the tolerance above
    exact = torch.nn.functional.linear(x, w, b)
    assert (y - exact).abs().max() > 1e-3 and (dw - dy.reshape(-1, 32).t() @ x.reshape(-1, 48)).abs().max() > 1e-6


def _quantized_dtypes(monkeypatch, recipe):
    seen = []
    real = fp8_gemm.quantize

    def spy(tensor, scale, dtype):
        seen.append((tuple(tensor.shape), dtype))
        return real(tensor, scale, dtype)

    monkeypatch.setattr(fp8_gemm, "quantize", spy)
    x, w, b, dy = _operands()
    _fp8_linear(recipe, x, w, b, dy)
    return seen


@pytest.mark.parametrize("fmt,grad_dtype", [("e4m3", E4M3), ("hybrid", E5M2)])
def test_hybrid_quantizes_gradients_to_e5m2_and_the_rest_to_e4m3(monkeypatch, fmt, grad_dtype):
    seen = _quantized_dtypes(monkeypatch, Fp8Recipe(format=fmt, scaling="tensorwise"))
    grads = {d for shape, d in seen if shape == (15, 32)}
    others = {d for shape, d in seen if shape != (15, 32)}
    assert grads == {grad_dtype} and others == {E4M3}, seen
    # fprop x, W; dy once for dgrad and wgrad; wgrad's x
    assert [shape for shape, _ in seen] == [(15, 48), (32, 48), (15, 32), (15, 48)]


@pytest.mark.parametrize("scaling", ["delayed", "tensorwise"])
def test_a_split_backward_casts_dy_in_the_layout_each_half_needs(monkeypatch, scaling):
    """A full backward casts dy once in both layouts (dgrad row-major, wgrad transposed); a
    zero-bubble B pass (input gradient only) casts it row-major, its W pass (weight gradient
    only) transposed: each half as it needs, with the full backward's gradients and amaxes."""
    recipe = Fp8Recipe(format="hybrid", scaling=scaling)
    casts, real = [], Fp8Gemm._quantized

    def spy(gemm, operand, tensor, record, layout="rows"):
        casts.append((operand, layout))
        return real(gemm, operand, tensor, record, layout)

    monkeypatch.setattr(Fp8Gemm, "_quantized", spy)
    x, w, b, dy = _operands()
    results = {}
    for split in (False, True):
        scaling_state = DelayedScaling(recipe) if scaling == "delayed" else TensorwiseScaling(recipe)
        gemm = Fp8Gemm(recipe, scaling_state, "column")
        xs, ws = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = tensor_parallel_linear(xs, ws, b, gemm)
        casts.clear()
        if split:
            (dx,) = torch.autograd.grad(y, xs, dy, retain_graph=True)
            b_casts = list(casts)
            (dw,) = torch.autograd.grad(y, ws, dy)
            assert b_casts == [(GRAD, "rows")] and casts[1:] == [(GRAD, "transposed"), (INPUT, "transposed")]
        else:
            dx, dw = torch.autograd.grad(y, (xs, ws), dy)
            assert casts == [(GRAD, "both"), (INPUT, "transposed")]
        history = scaling_state.amax_history.clone() if scaling == "delayed" else None
        results[split] = (dx, dw, history)
    assert all(torch.equal(a, b) for a, b in zip(results[False][:2], results[True][:2]))
    if scaling == "delayed":
        assert torch.equal(results[False][2], results[True][2])


def test_no_fp8_wgrad_keeps_the_weight_gradient_gemm_16_bit(monkeypatch):
    x, w, b, dy = _operands()
    recipe = Fp8Recipe(format="hybrid", scaling="tensorwise", wgrad=False)
    _, dx, dw, _ = _fp8_linear(recipe, x, w, b, dy)
    assert torch.equal(dw, dy.reshape(-1, 32).t().mm(x.reshape(-1, 48)))  # the plain GEMM, exactly
    _, dx_fp8, dw_fp8, _ = _fp8_linear(Fp8Recipe(format="hybrid", scaling="tensorwise"), x, w, b, dy)
    assert torch.equal(dx, dx_fp8) and not torch.equal(dw, dw_fp8)  # dgrad is still FP8
    assert len(_quantized_dtypes(monkeypatch, recipe)) == 3  # no quantization for the wgrad GEMM


def test_fused_fp8_wgrad_accumulates_the_fp8_product_into_main_grad():
    x, w, b, dy = _operands()
    recipe = Fp8Recipe(format="hybrid", scaling="tensorwise")
    _, _, dw, _ = _fp8_linear(recipe, x, w, b, dy)
    main_grad = torch.full_like(w, 0.25)
    Fp8Gemm(recipe, TensorwiseScaling(recipe), "column").wgrad_accumulate(
        main_grad, dy.reshape(-1, 32), x.reshape(-1, 48))
    assert torch.allclose(main_grad, dw + 0.25, rtol=1e-6, atol=1e-9)


def _window_scale(amaxes, recipe, operand_dtype, previous):
    window = amaxes[-recipe.amax_history_len:] if recipe.amax_compute_algo == "max" else amaxes[-1:]
    amax = max(window)
    return previous if amax == 0 else MAX[operand_dtype] / amax / 2 ** recipe.margin


@pytest.mark.parametrize("algo,length,margin", [("most_recent", 1, 0), ("max", 3, 1), ("most_recent", 4, 2)])
def test_delayed_scaling_history_and_scales_step_by_step(algo, length, margin):
    recipe = Fp8Recipe(format="hybrid", amax_history_len=length, amax_compute_algo=algo, margin=margin)
    state = DelayedScaling(recipe)
    steps = [[3.0, 0.5, 2e-3], [7.0, 0.25, 1e-3], [1.0, 0.5, 0.0], [2.0, 0.125, 4e-3], [0.5, 1.0, 5e-4]]
    dtypes = (E4M3, E4M3, E5M2)
    expected = [1.0, 1.0, 1.0]
    seen = [[], [], []]
    for k, amaxes in enumerate(steps):
        for op, amax in enumerate(amaxes):
            for fraction in (0.5, 1.0):  # two micro-batches: the step's amax is their max
                tensor = torch.tensor([[amax * fraction, -amax * fraction / 3]])
                used = state.scale(op, tensor, split=False)
                assert float(used) == pytest.approx(expected[op], rel=1e-6), (k, op)  # last step's scale
            seen[op].append(amax)
        state.update()
        for op in range(3):
            expected[op] = _window_scale(seen[op], recipe, dtypes[op], expected[op])
            assert float(state.scales[op]) == pytest.approx(expected[op], rel=1e-6), (k, op)
            # the history after the roll: row 0 zeroed, row i the amax of step k - L + 1 + i
            for i in range(1, length):
                j = k - length + 1 + i
                assert float(state.amax_history[i, op]) == pytest.approx(seen[op][j] if j >= 0 else 0.0)
            assert float(state.amax_history[0, op]) == 0.0


def test_a_forward_that_does_not_record_leaves_the_history_alone():
    """record_forward False (evaluation: set by the layer's pre-hook, tests/parallel/tensor/
    test_fp8_model.py) quantizes with the current scales and records nothing; True records x's
    and W's amaxes; backward records the output gradient's."""
    recipe = Fp8Recipe(format="hybrid", amax_history_len=2)
    x, w, b, _ = _operands()
    gemm = Fp8Gemm(recipe, DelayedScaling(recipe), "column")
    gemm.record_forward = False
    tensor_parallel_linear(x, w, b, gemm)
    assert gemm.scaling.amax_history.abs().sum() == 0
    gemm.record_forward = True
    y = tensor_parallel_linear(x, w.clone().requires_grad_(), b, gemm)
    assert gemm.scaling.amax_history[0, INPUT] == x.abs().max() and gemm.scaling.amax_history[0, WEIGHT] == w.abs().max()
    assert gemm.scaling.amax_history[0, GRAD] == 0
    dy = torch.randn_like(y)
    y.backward(dy)
    assert gemm.scaling.amax_history[0, GRAD] == dy.abs().max()


def test_delayed_states_save_and_restore_and_refuse_another_history_length():
    recipe = Fp8Recipe(amax_history_len=2, amax_compute_algo="max")
    a = DelayedScalingStates({"l": DelayedScaling(recipe)})
    a.states["l"].scale(INPUT, torch.tensor([4.0]), split=False)
    a.after_optimizer_step()
    b = DelayedScalingStates({"l": DelayedScaling(recipe)})
    b.load_state_dict(a.state_dict())
    assert torch.equal(b.states["l"].amax_history, a.states["l"].amax_history)
    assert torch.equal(b.states["l"].scales, a.states["l"].scales) and float(b.states["l"].scales[INPUT]) == 112.0
    other = DelayedScalingStates({"l": DelayedScaling(Fp8Recipe(amax_history_len=3))})
    with pytest.raises(ValueError, match="fp8-amax-history-len"):
        other.load_state_dict(a.state_dict())
