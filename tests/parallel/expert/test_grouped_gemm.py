"""grouped_mm: the loop of matmuls equals per-expert matmuls (empty experts included, gradients
too; with no rows at all its output stays in the autograd graph); on a CUDA device of compute capability 9.0 with bf16 (faked: FakeTensorMode, no GPU
needed) --moe-grouped-gemm takes torch._grouped_mm with int32 cumulative offsets, and without
the flag the loop."""

import unittest.mock as mock

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megalite.parallel.expert.grouped_gemm import grouped_mm


def test_loop_matches_per_expert_matmuls():
    counts = [3, 0, 5, 2]
    x = torch.randn(10, 6, requires_grad=True)
    w = torch.randn(4, 6, 7, requires_grad=True)
    y = grouped_mm(x, w, counts)
    starts = [0, 3, 3, 8, 10]
    want = torch.cat([x[starts[e]:starts[e + 1]] @ w[e] for e in range(4)])
    torch.testing.assert_close(y, want)
    y.square().sum().backward()
    gx, gw = x.grad.clone(), w.grad.clone()
    x.grad = w.grad = None
    want.square().sum().backward()
    torch.testing.assert_close(gx, x.grad)
    torch.testing.assert_close(gw, w.grad)
    assert torch.equal(gw[1], torch.zeros(6, 7))


def test_no_rows_stay_in_the_graph():
    """A rank whose experts got no tokens: the empty output still depends on the rows and the
    weights, so that rank's backward runs the dispatcher's collectives as its EP peers do."""
    x = torch.randn(10, 6, requires_grad=True)
    w = torch.randn(4, 6, 7, requires_grad=True)
    y = grouped_mm(x[:0], w, [0, 0, 0, 0])
    assert y.shape == (0, 7) and y.grad_fn is not None
    y.sum().backward()
    assert torch.equal(x.grad, torch.zeros(10, 6)) and torch.equal(w.grad, torch.zeros(4, 6, 7))


def test_cuda_path_uses_torch_grouped_mm():
    real = torch._grouped_mm
    with FakeTensorMode(), mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)), \
            mock.patch("torch._grouped_mm", side_effect=real) as spy:
        x = torch.empty(40, 32, dtype=torch.bfloat16, device="cuda")
        w = torch.empty(4, 48, 32, dtype=torch.bfloat16, device="cuda").transpose(1, 2)  # MoELayer's layout
        y = grouped_mm(x, w, [10, 0, 20, 10])
        assert y.shape == (40, 48) and y.dtype == torch.bfloat16 and spy.call_count == 1
        offsets = spy.call_args.kwargs["offs"]
        assert offsets.dtype == torch.int32 and offsets.shape == (4,)
        grouped_mm(x, w, [10, 0, 20, 10], use_grouped=False)  # --moe-grouped-gemm off: the loop
        grouped_mm(x.float(), w.float(), [10, 0, 20, 10])  # fp32: the loop
        assert spy.call_count == 1
