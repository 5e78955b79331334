"""torch.compile(fullgraph=True) through every Triton op: the launchers are torch.library
operators with registered autograd, so Dynamo captures them with no graph break and the compiled
graph runs the same kernels and matches eager bit for bit."""

import torch

from megalite.kernels import apply_rotary, bias_gelu, cross_entropy, layer_norm, rms_norm, swiglu


def _block(x, w, b, cos, sin, target):
    y = rms_norm(x, w, 1e-6, impl="triton")
    y = layer_norm(y, w, b, 1e-5, impl="triton")
    y = apply_rotary(y.view(4, 2, 2, 8), cos, sin, impl="triton").view(4, 2, 16)
    y = bias_gelu(y, b, "tanh", impl="triton")
    y = swiglu(y, impl="triton")
    return cross_entropy(y, target, label_smoothing=0.1, impl="triton").sum()


def test_fullgraph_compile_matches_eager(device):
    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(shape, generator=g).to(device).requires_grad_() for shape in ((4, 2, 16), (16,), (16,)))
    cos, sin = (torch.randn((4, 1, 8), generator=g).to(device) for _ in range(2))
    target = torch.randint(0, 8, (4, 2), generator=g).to(device)
    compiled = torch.compile(_block, backend="aot_eager", fullgraph=True)
    loss = compiled(x, w, b, cos, sin, target)
    grads = torch.autograd.grad(loss, [x, w, b])
    eager_loss = _block(x, w, b, cos, sin, target)
    eager_grads = torch.autograd.grad(eager_loss, [x, w, b])
    assert torch.equal(loss, eager_loss)
    for got, want in zip(grads, eager_grads):
        assert torch.equal(got, want)
