"""The Triton launchers are PyTorch operators (torch.library): torch.library.opcheck checks each
one's schema, its fake implementation against the real kernel's outputs (shapes, dtypes,
strides), its autograd registration and its trace through AOTAutograd; and the autograd graph of
every public op on the Triton path is the operators' registered autograd, with no
torch.autograd.Function of megalite's in it. The numbers of forward and backward against the
references are in test_norms.py, test_activations.py, test_rotary.py, test_cross_entropy.py.
Under TRITON_INTERPRET=1 (conftest.py) the operators are custom_ops with explicit fake
implementations; compiled Triton makes them triton_ops (tests/dryrun/test_fake_cuda.py)."""

import pytest
import torch

from megalite.kernels import apply_rotary, bias_gelu, cross_entropy, layer_norm, rms_norm, swiglu

pytest.importorskip("triton")


def _tensors(dtype, requires_grad):
    g = torch.Generator().manual_seed(0)

    def randn(*shape, grad=requires_grad):
        return torch.randn(shape, generator=g).to(dtype).requires_grad_(grad)
    return randn


def _op_cases(dtype):
    from megalite.kernels import activations_triton as act, cross_entropy_triton as ce, norms_triton as norms, \
        rotary_triton as rot

    randn = _tensors(dtype, requires_grad=True)
    const = _tensors(dtype, requires_grad=False)
    x, w, b = randn(6, 16), randn(16), randn(16)
    dy, x2 = const(6, 16), const(6, 32)
    stats = torch.rand(6) + 0.5
    target = torch.tensor([0, 3, -1, 15, 7, 2])
    logits = const(6, 16)
    fp32 = _tensors(torch.float32, requires_grad=False)
    return [
        (norms.norm_forward, (x, w, b, 1e-5, False)), (norms.norm_forward, (x, w, None, 1e-5, True)),
        (norms.norm_backward, (dy, x.detach(), w.detach(), True, stats, stats, False)),
        (act.swiglu_forward, (randn(6, 32),)), (act.swiglu_backward, (dy, x2)),
        (act.bias_gelu_forward, (x, b, True)), (act.bias_gelu_forward, (x, None, False)),
        (act.bias_gelu_backward, (dy, x.detach(), b.detach(), False)),
        (rot.rotary, (randn(4, 2, 2, 8), fp32(4, 1, 6), fp32(4, 1, 6), False)),
        (ce.local_stats, (logits, target, 14, True)),
        (ce.grad_logits, (logits, target, stats, stats, stats, 14, 0.1, torch.full((1,), 0.01))),
        (ce.grad_logits_, (logits.clone(), target, stats, stats, stats, 14, 0.1, torch.full((1,), 0.01))),
        (ce.loss_from_statistics, (randn(6, 16), target, stats, stats, stats, stats, torch.full((1,), 0.01), 14, 0.1,
                                   False)),
    ]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_opcheck_every_kernel_operator(dtype):
    cases = _op_cases(dtype)
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


@pytest.mark.parametrize("name", ["rms_norm", "layer_norm", "swiglu", "bias_gelu", "apply_rotary", "cross_entropy"])
def test_triton_path_differentiates_through_the_registered_autograd(name):
    randn = _tensors(torch.float32, requires_grad=True)
    x, w, b = randn(4, 2, 16), randn(16), randn(16)
    cos, sin = (_tensors(torch.float32, False)(4, 1, 8) for _ in range(2))
    calls = {"rms_norm": (lambda: rms_norm(x, w, impl="triton"), "norm_forward"),
             "layer_norm": (lambda: layer_norm(x, w, b, impl="triton"), "norm_forward"),
             "swiglu": (lambda: swiglu(x, impl="triton"), "swiglu_forward"),
             "bias_gelu": (lambda: bias_gelu(x, b, impl="triton"), "bias_gelu_forward"),
             "apply_rotary": (lambda: apply_rotary(x.view(4, 2, 2, 8), cos, sin, impl="triton"), "rotary"),
             "cross_entropy": (lambda: cross_entropy(x, torch.zeros(4, 2, dtype=torch.long), impl="triton"),
                               "cross_entropy_loss")}
    call, op = calls[name]
    names = [type(node).__name__ for node in _autograd_nodes(call())]
    assert f"GeneratedBackwardFor_megalite_kernels_{op}_defaultBackward" in names, names
    ours = [type(n).__qualname__ for n in _autograd_nodes(call()) if type(n).__module__.startswith("megalite")]
    assert not ours, f"{name}: autograd.Functions of megalite in the graph: {ours}"
