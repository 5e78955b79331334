"""Every Triton op runs on fake tensors (FakeTensorMode, as a dry run uses them): the launchers
answer through their custom ops' fake implementations, forward and backward, with the shapes,
dtypes and devices the real kernels give; and impl='auto' picks the same path for a fake tensor
as for a real one on the same device."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from megalite.kernels.dispatch import use_triton
from tests.kernels.test_torch_compile import _block


class OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.add(str(func))
        return func(*args, **(kwargs or {}))


def _inputs(device, fake_mode=None):
    g = torch.Generator().manual_seed(0)
    real = [torch.randn(s, generator=g) for s in ((4, 2, 16), (16,), (16,), (4, 1, 8), (4, 1, 8))]
    real.append(torch.randint(0, 8, (4, 2), generator=g))
    if fake_mode is not None:
        real = [fake_mode.from_tensor(t) for t in real]
    x, w, b, cos, sin, target = (t.to(device) for t in real)
    for t in (x, w, b):
        t.requires_grad_()
    return x, w, b, cos, sin, target


def _run(inputs):
    loss = _block(*inputs)
    grads = torch.autograd.grad(loss, inputs[:3])
    return [(tuple(t.shape), t.dtype, t.device.type, t.stride()) for t in (loss, *grads)]


def test_triton_ops_run_on_fake_tensors(device):
    want = _run(_inputs(device))
    mode = FakeTensorMode()
    log = OpLog()
    with mode:
        inputs = _inputs(device, mode)
        with log:
            got = _run(inputs)
    assert got == want
    ours = {n.split(".")[1] for n in log.names if n.startswith("megalite_kernels.")}
    assert ours >= {"norm_forward", "norm_backward", "rotary", "swiglu_forward", "swiglu_backward",
                    "bias_gelu_forward", "bias_gelu_backward", "ce_local_stats", "ce_grad_logits"}, ours


def test_auto_chooses_the_same_path_for_fake_and_real_tensors():
    real = torch.zeros(2)
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(real)
        assert use_triton("op", "auto", fake) == use_triton("op", "auto", real) is False
        assert use_triton("op", "auto", fake.to("meta")) is False
