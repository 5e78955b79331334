"""ZB-H1's split backward on GPT-2 and Llama chunks (first, middle and last pipeline stage, and
a whole model whose output layer reuses the input embedding): B computes the input gradient and
no weight gradient, W computes exactly the weight-gradient matmuls, and together they give the
full backward's gradients. Single process, fp32.

Matmul work is measured with torch's FlopCounterMode: a linear layer's weight gradient costs
what its forward matmul costs, so W's flops must equal the forward's linear (mm/addmm) flops,
and B's the rest of a full backward."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from megalite.model.gpt import GPTModel, masked_mean_loss
from megalite.parallel.data.ddp import DistributedDataParallel, main_grad_of
from megalite.parallel.pipeline.split_backward import SplitBackward
from megalite.parallel.state import ParallelState
from tests.numerics import assert_rel_close
from tests.parallel.pipeline.pipeline_cases import FAMILIES, HIDDEN, MICRO_BATCH, SEQ, make_config, microbatches

TOL = 1e-6
# stage: (layers, pre_process, post_process)
STAGES = {"first": ([0, 1], True, False), "middle": ([2, 3], False, False),
          "last": ([6, 7], False, True), "whole": (list(range(8)), True, True)}
LINEAR_MATMULS = {torch.ops.aten.mm, torch.ops.aten.addmm}


def _chunk(family, stage):
    layers, pre, post = STAGES[stage]
    return GPTModel(make_config(family), ParallelState.single(), layer_numbers=layers,
                    pre_process=pre, post_process=post, init_seed=3)


def _forward(model, stage):
    """(output, gradient arriving from the next stage, the chunk's input or None)."""
    _, pre, post = STAGES[stage]
    batch = microbatches(1)[0]
    g = torch.Generator().manual_seed(5)
    hidden = None if pre else torch.randn(SEQ, MICRO_BATCH, HIDDEN, generator=g).requires_grad_()
    out = model(tokens=batch["tokens"] if pre else None, labels=batch["labels"] if post else None,
                hidden_states=hidden)
    if post:
        return masked_mean_loss(out, batch["loss_mask"]), None, hidden
    return out, torch.randn(out.shape, generator=g), hidden


def _flops(counter, ops=None):
    counts = counter.get_flop_counts()["Global"]
    return sum(n for op, n in counts.items() if ops is None or op in ops)


@pytest.mark.parametrize("stage", list(STAGES))
@pytest.mark.parametrize("family", FAMILIES)
def test_b_leaves_weight_gradients_to_w(family, stage):
    reference = _chunk(family, stage)
    out, grad, reference_input = _forward(reference, stage)
    with FlopCounterMode(display=False) as full:
        torch.autograd.backward(out, grad)
    expected = {name: p.grad for name, p in reference.named_parameters()}
    assert all(g is not None for g in expected.values())

    model = _chunk(family, stage)
    wrapped = DistributedDataParallel(model, ParallelState.single())
    split = SplitBackward(model)
    with FlopCounterMode(display=False) as forward, split.record() as record:
        out, grad, hidden = _forward(wrapped, stage)
    with FlopCounterMode(display=False) as input_half:
        input_grad = split.input_backward(record, out, grad, hidden)
    for name, p in model.named_parameters():
        assert p.grad is None, f"B produced a gradient for {name}"
        assert torch.count_nonzero(main_grad_of(p)) == 0, f"B accumulated into {name}'s main_grad"
    if hidden is not None:
        assert_rel_close(input_grad, reference_input.grad, TOL, f"{family} {stage} input gradient")
    else:
        assert input_grad is None
    with FlopCounterMode(display=False) as weight_half:
        split.weight_backward(record)
    for name, p in model.named_parameters():
        assert_rel_close(main_grad_of(p), expected[name], TOL, f"{family} {stage} grad {name}")

    weight_flops, linear_forward = _flops(weight_half), _flops(forward, LINEAR_MATMULS)
    assert weight_flops == linear_forward, "W did other work than the weight-gradient matmuls"
    assert _flops(input_half) + weight_flops == _flops(full), "B and W together are not one backward"
    # B holds the input-gradient matmuls (about as many flops as the weight gradients) and the
    # attention backward, which at these shapes is small.
    assert 0.4 < _flops(input_half) / _flops(full) < 0.6

