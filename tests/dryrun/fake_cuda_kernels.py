"""Run by test_fake_cuda.py in a process with the fake CUDA device (the shim preloaded): the
kernels' fused path on fake CUDA tensors, in bf16, forward and backward."""

import json
import sys

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from megalite.dryrun.fake_cuda import exit_now
from megalite.dryrun.gpu_attention import GpuAttention
from megalite.kernels import apply_rotary, bias_gelu, cross_entropy, layer_norm, rms_norm, swiglu
from megalite.kernels.dispatch import use_triton
from tests.kernels.test_fake_tensors import OpLog


def block(x, w, b, cos, sin, target, impl):
    y = rms_norm(x, w, 1e-6, impl=impl)
    y = layer_norm(y, w, b, 1e-5, impl=impl)
    y = apply_rotary(y.view(4, 2, 2, 8), cos, sin, impl=impl).view(4, 2, 16)
    y = bias_gelu(y, b, "tanh", impl=impl)
    y = swiglu(y, impl=impl)
    return cross_entropy(y, target, label_smoothing=0.1, impl=impl).sum()


def run(impl):
    log = OpLog()
    with FakeTensorMode(), GpuAttention():  # GpuAttention: the modelled H100's SM count
        x, w, b = (torch.randn(s, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for s in ((4, 2, 16), (16,), (16,)))
        cos, sin = (torch.randn((4, 1, 8), device="cuda", dtype=torch.bfloat16) for _ in range(2))
        target = torch.randint(0, 8, (4, 2), device="cuda")
        auto_is_triton = use_triton("op", "auto", x)
        with log:
            loss = block(x, w, b, cos, sin, target, impl)
            grads = torch.autograd.grad(loss, [x, w, b])
    return {"auto_is_triton": auto_is_triton,
            "ops": sorted({n.split(".")[1] for n in log.names if n.startswith("megalite_kernels.")}),
            "out": [[list(t.shape), str(t.dtype), str(t.device)] for t in (loss, *grads)]}


if __name__ == "__main__":
    json.dump({impl: run(impl) for impl in ("auto", "torch")}, sys.stdout)
    exit_now(0)
