"""The planner's memory per rank against shared/docs/formulas.md: bytes per parameter by
precision and distributed optimizer, Korthikanti's activation bytes per layer for each row of
the table, the in-flight micro-batches of each schedule, and the extras the planner adds
(context-parallel split, recompute working set, logits)."""

import pytest

from megalite.planner.layouts import Layout
from megalite.planner.memory import layer_activation_bytes, peak_memory, rank_memory, state_bytes
from megalite.planner.parameters import rank_parameters
from tests.planner.models import GPT, workload

S, B, H, A = 128, 2, 64, 4


def layout(tp=1, pp=1, dp=1, vp=1, cp=1, mbs=B, sp=False, recompute="none", do=False, schedule=None):
    schedule = schedule or ("none" if pp == 1 else "interleaved_1f1b" if vp > 1 else "1f1b")
    return Layout(tp, pp, dp, vp, cp, 1, mbs, sp, recompute, do, schedule)


@pytest.mark.parametrize("precision, distributed, d, per_param", [
    ("bf16", False, 1, 18), ("fp16", False, 1, 20), ("fp32", False, 1, 16),
    ("bf16", True, 4, 6 + 12 / 4), ("fp16", True, 4, 4 + 16 / 4), ("fp32", True, 8, 8 + 8 / 8)])
def test_state_bytes_per_parameter_are_formulas_rows(precision, distributed, d, per_param):
    weights, grads, optimizer = state_bytes(precision, 1000, distributed, d)
    assert weights + grads + optimizer == pytest.approx(per_param * 1000)
    assert weights == {"bf16": 2, "fp16": 2, "fp32": 4}[precision] * 1000
    assert grads == {"bf16": 4, "fp16": 2, "fp32": 4}[precision] * 1000


def table_row(t, sp, recompute, flash):
    """formulas.md's activation table, bytes per layer (16-bit)."""
    s, b, h, a = S, B, H, A
    scores = 0 if flash else 5 * a * s / (h * t)
    if recompute == "full":
        return 2 * s * b * h
    if recompute == "selective":
        return 34 * s * b * h / t if sp else s * b * h * (10 + 24 / t)
    if t == 1:
        return s * b * h * (34 + scores)
    return s * b * h * (34 / t + scores) if sp else s * b * h * (10 + 24 / t + scores)


@pytest.mark.parametrize("t, sp", [(1, False), (2, False), (2, True), (4, True)])
@pytest.mark.parametrize("recompute", ["none", "selective", "full"])
@pytest.mark.parametrize("flash", [False, True])
def test_activation_bytes_per_layer_follow_the_table(t, sp, recompute, flash):
    got = layer_activation_bytes(workload(GPT, S, 16, flash=flash), layout(tp=t, sp=sp, recompute=recompute))
    expected = table_row(t, sp, recompute, flash)
    if recompute == "full" and sp:
        expected /= t  # the kept layer input is sequence-split (the planner's note, not the table's)
    assert got == pytest.approx(expected)


def test_fp32_activations_and_context_parallelism():
    base = layer_activation_bytes(workload(GPT, S, 16), layout(tp=2, sp=True))
    assert layer_activation_bytes(workload(GPT, S, 16, precision="fp32"), layout(tp=2, sp=True)) == 2 * base
    assert layer_activation_bytes(workload(GPT, 2 * S, 16), layout(tp=2, sp=True, cp=2)) == pytest.approx(base)


@pytest.mark.parametrize("p, m", [(2, 8), (4, 8), (4, 2)])
def test_one_f_one_b_keeps_min_p_m_micro_batches_on_the_first_stage(p, m):
    lay = layout(pp=p, mbs=16 // m)
    mem = rank_memory(workload(GPT, S, 16), lay, 0)
    assert mem.held_microbatches == min(p, m)
    layers = GPT.num_layers // p
    per_layer = layer_activation_bytes(workload(GPT, S, 16), lay)
    assert mem.activations == pytest.approx(min(p, m) * layers * per_layer)
    assert rank_memory(workload(GPT, S, 16), lay, p - 1).held_microbatches == 1


def test_interleaving_multiplies_the_first_stage_by_the_formula():
    p, v, m = 2, 2, 8
    mem = rank_memory(workload(GPT, S, 16), layout(pp=p, vp=v, mbs=16 // m), 0)
    assert mem.held_microbatches == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_gpipe_keeps_every_micro_batch():
    mem = rank_memory(workload(GPT, S, 16), layout(pp=2, mbs=2, schedule="gpipe"), 0)
    assert mem.held_microbatches == 8


def test_extras_and_state_add_up():
    w = workload(GPT, S, 16)
    lay = layout(tp=2, pp=2, dp=2, recompute="full", do=True)
    first, last = rank_memory(w, lay, 0), rank_memory(w, lay, 1)
    dense, _ = rank_parameters(GPT, 2, 2, 1, 0)
    assert first.parameters + first.gradients + first.optimizer == pytest.approx(dense * (6 + 12 / 2))
    assert first.recompute == layer_activation_bytes(w, lay, "none") and first.logits == 0
    vocab = GPT.padded_vocab_size(2) // 2
    assert last.logits == S * B * vocab * (2 + 4)
    assert first.total == pytest.approx(first.parameters + first.gradients + first.optimizer + first.activations
                                        + first.recompute)
    assert peak_memory(w, lay).total == max(first.total, last.total)
    assert rank_memory(w, layout(tp=2, pp=2, dp=2), 0).recompute == 0
