"""The Triton launchers are PyTorch operators (torch.library): torch.library.opcheck checks each
one's schema, its fake implementation against the real kernel's outputs (shapes, dtypes,
strides), its autograd registration and its trace through AOTAutograd. Every public op has two
paths to the same kernels: on plain tensors in eager mode a torch.autograd.Function of megalite's
launches them directly (the operator dispatch costs more host time than the kernel at small
sizes); under torch.compile, FakeTensorMode or any dispatch mode the operators run, with their
registered autograd. Both paths give the same numbers bit for bit. The numbers of forward and
backward against the references are in test_norms.py, test_activations.py, test_rotary.py,
test_cross_entropy.py. Under TRITON_INTERPRET=1 (conftest.py) the operators are custom_ops with
explicit fake implementations; compiled Triton makes them triton_ops (tests/dryrun/test_fake_cuda.py)."""

import pytest
import torch

from megalite.kernels import apply_rotary, bias_dropout_add, bias_gelu, cross_entropy, layer_norm, rms_norm, swiglu
from tests.kernels.test_fake_tensors import OpLog

pytest.importorskip("triton")


def _tensors(dtype, requires_grad, device):
    g = torch.Generator().manual_seed(0)

    def randn(*shape, grad=requires_grad):
        return torch.randn(shape, generator=g).to(device=device, dtype=dtype).requires_grad_(grad)
    return randn


def _op_cases(dtype, device):
    from megalite.kernels import activations_triton as act, bias_dropout_add_triton as bda, \
        cross_entropy_triton as ce, fp8_cast_triton as fp8, norms_triton as norms, rotary_triton as rot

    randn = _tensors(dtype, True, device)
    const = _tensors(dtype, False, device)
    x, w, b = randn(6, 16), randn(16), randn(16)
    dy, x2 = const(6, 16), const(6, 32)
    stats = torch.rand(6, device=device) + 0.5
    target = torch.tensor([0, 3, -1, 15, 7, 2], device=device)
    logits = const(6, 16)
    fp32 = _tensors(torch.float32, False, device)
    smooth = torch.full((1,), 0.01, device=device)
    return [
        (norms.norm_forward, (x, w, b, 1e-5, False)), (norms.norm_forward, (x, w, None, 1e-5, True)),
        (norms.norm_backward, (dy, x.detach(), w.detach(), True, stats, stats, False)),
        (act.swiglu_forward, (randn(6, 32),)), (act.swiglu_backward, (dy, x2)),
        (act.bias_gelu_forward, (x, b, True)), (act.bias_gelu_forward, (x, None, False)),
        (act.bias_gelu_backward, (dy, x.detach(), b.detach(), False)),
        (rot.rotary, (randn(4, 2, 2, 8), fp32(4, 1, 6), fp32(4, 1, 6), False)),
        (ce.local_stats, (logits, target, 14, True)),
        (ce.grad_logits, (logits, target, stats, stats, stats, 14, 0.1, smooth)),
        (ce.grad_logits_, (logits.clone(), target, stats, stats, stats, 14, 0.1, smooth)),
        (ce.loss_from_statistics, (randn(6, 16), target, stats, stats, stats, stats, smooth, 14, 0.1, False)),
        (bda.bias_dropout_add_forward, (x, b, randn(6, 16), torch.tensor([5], device=device), 0.2)),
        (bda.bias_dropout_add_forward, (x, None, randn(6, 16), None, 0.0)),
        (bda.bias_dropout_add_backward, (dy, torch.tensor([5], device=device), 0.2, True)),
        (fp8.fp8_amax_op, (dy,)),
        (fp8.fp8_cast_op, (dy, fp32(1).abs() + 1, torch.zeros((), device=device), torch.float8_e4m3fn, True)),
        (fp8.fp8_cast_transposed_op, (dy, fp32(1).abs() + 1, torch.zeros((), device=device), torch.float8_e5m2, False)),
        (fp8.fp8_cast_transpose_op, (dy, fp32(1).abs() + 1, torch.zeros((), device=device), torch.float8_e5m2, True)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_every_kernel_operator(dtype, device):
    cases = _op_cases(dtype, device)
    from torch._library.custom_ops import OPDEFS

    registered = {name for name in OPDEFS if name.startswith("megalite_kernels::")}
    assert {f"megalite_kernels::{op._name}" for op, _ in cases} == registered  # every operator is checked
    for op, args in cases:
        torch.library.opcheck(op, args)


def _autograd_nodes(t: torch.Tensor) -> list:
    seen, stack = [], [t.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.append(node)
        stack.extend(n for n, _ in node.next_functions)
    return seen


_CALLS = {  # public op -> (call on x [4, 2, 16], w, b, cos, sin, its operator, the eager path's Function)
    "rms_norm": (lambda x, w, b, cos, sin: rms_norm(x, w, impl="triton"), "norm_forward", "NormFunction"),
    "layer_norm": (lambda x, w, b, cos, sin: layer_norm(x, w, b, impl="triton"), "norm_forward", "NormFunction"),
    "swiglu": (lambda x, w, b, cos, sin: swiglu(x, impl="triton"), "swiglu_forward", "SwigluFunction"),
    "bias_gelu": (lambda x, w, b, cos, sin: bias_gelu(x, b, impl="triton"), "bias_gelu_forward", "BiasGeluFunction"),
    "bias_dropout_add": (lambda x, w, b, cos, sin: bias_dropout_add(x, b, x * 2, 0.0, impl="triton"),
                         "bias_dropout_add_forward", "BiasDropoutAddFunction"),
    "apply_rotary": (lambda x, w, b, cos, sin: apply_rotary(x.view(4, 2, 2, 8), cos, sin, impl="triton"), "rotary",
                     "RotaryFunction"),
    "cross_entropy": (lambda x, w, b, cos, sin: cross_entropy(x, torch.zeros(4, 2, dtype=torch.long, device=x.device),
                                                              label_smoothing=0.1, impl="triton"),
                      "cross_entropy_loss", "UnshardedLoss"),
    # global ids from vocab_start 3, some outside this shard's 14 valid columns (masked in the kernels)
    "cross_entropy_offset": (lambda x, w, b, cos, sin: cross_entropy(
        x, torch.tensor([[0, 3], [5, 18], [19, 25], [10, 4]], device=x.device), vocab_start=3, valid_vocab=14,
        impl="triton"), "cross_entropy_loss", "UnshardedLoss"),
}


@pytest.mark.parametrize("name", sorted(_CALLS))
def test_eager_path_and_operator_path_agree(name, device):
    """Eagerly, the op differentiates through megalite's Function, not an operator's autograd;
    under a dispatch mode (as under FakeTensorMode or torch.compile) through
    the operator's registered autograd. Same values and gradients, bit for bit."""
    randn = _tensors(torch.float32, True, device)
    x, w, b = randn(4, 2, 16), randn(16), randn(16)
    cos, sin = (_tensors(torch.float32, False, device)(4, 1, 8) for _ in range(2))
    call, op, function = _CALLS[name]
    results = {}
    for path in ("eager", "operator"):
        log = OpLog()
        if path == "operator":
            with log:
                y = call(x, w, b, cos, sin)
                grads = torch.autograd.grad(y.sum(), [x, w, b], allow_unused=True)
        else:
            y = call(x, w, b, cos, sin)
            grads = torch.autograd.grad(y.sum(), [x, w, b], allow_unused=True)
        nodes = [type(n).__name__ for n in _autograd_nodes(y)]
        ours = {n.split(".")[1] for n in log.names if n.startswith("megalite_kernels.")}
        if path == "operator":
            assert f"GeneratedBackwardFor_megalite_kernels_{op}_defaultBackward" in nodes, nodes
            assert op in ours, ours
        else:
            assert f"{function}Backward" in nodes and not any(n.startswith("GeneratedBackwardFor") for n in nodes), nodes
        results[path] = (y, grads)
    (y_eager, g_eager), (y_op, g_op) = results["eager"], results["operator"]
    assert torch.equal(y_eager, y_op)
    for got, want in zip(g_eager, g_op):
        assert (got is None and want is None) or torch.equal(got, want)
