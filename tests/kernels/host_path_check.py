"""Run by test_host_path.py in a process with compiled Triton: megalite's eager path for RMSNorm,
forward and backward (and LayerNorm's launches), on the GPU if there is one, else on CPU tensors through
bench_host_overhead's HostOnlyDriver (kernels compiled for sm_90, launches not made). Prints
JSON: how the calls went."""

import json
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools" / "benchmarks"))

from bench_host_overhead import install_host_only_driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    install_host_only_driver()

from megalite import kernels  # noqa: E402
from megalite.kernels import norms_triton, triton_common  # noqa: E402

runs, launches = [], []
original_run, original_launch = JITFunction.run, triton_common.DirectLauncher.launch


def counting_run(self, *args, **kwargs):
    runs.append(self.__name__)
    return original_run(self, *args, **kwargs)


def counting_launch(self, *args, **kwargs):
    launches.append(self.kernel.__name__)
    return original_launch(self, *args, **kwargs)


def no_operator(*args, **kwargs):
    raise AssertionError("the eager path called the operator")


torch_reductions = []  # Tensor.sum / Tensor.to calls: the parameter gradients' sums and casts are a kernel's


def counting(method):
    original = getattr(torch.Tensor, method)

    def wrapper(self, *args, **kwargs):
        torch_reductions.append(method)
        return original(self, *args, **kwargs)
    return wrapper


JITFunction.run = counting_run
triton_common.DirectLauncher.launch = counting_launch
norms_triton.norm_forward = norms_triton.norm_backward = no_operator
x = torch.randn(8, 64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
w = torch.randn(64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
dy = torch.randn(8, 64, dtype=torch.bfloat16, device=DEVICE)
b = torch.randn(64, dtype=torch.bfloat16, device=DEVICE, requires_grad=True)
calls, layer_norm_calls = [], []
torch.Tensor.sum, torch.Tensor.to = counting("sum"), counting("to")
for _ in range(5):
    before = (len(runs), len(launches))
    torch.autograd.grad(kernels.rms_norm(x, w, impl="triton"), [x, w], dy)
    calls.append([len(runs) - before[0], len(launches) - before[1]])
# A view whose address is not a multiple of 16 (Triton specialises on that): a new launch through run().
offset = torch.randn(8 * 64 + 1, dtype=torch.bfloat16, device=DEVICE)[1:].view(8, 64)
before = len(runs)
kernels.rms_norm(offset, w.detach(), impl="triton")
misaligned_runs = len(runs) - before
launcher = triton_common.direct(norms_triton._norm_fwd_kernel)
specialisations = len(launcher.compiled)
for _ in range(2):
    before = len(launches)
    torch.autograd.grad(kernels.layer_norm(x, w, b, impl="triton"), [x, w, b], dy)
    layer_norm_calls.append(len(launches) - before)
# A profiler's launch hook (Triton's launch_enter_hook) needs the launch metadata that Triton's
# runner (CompiledKernel[grid]) builds: with one set, launches go through the runner; without, not.
from triton.compiler import CompiledKernel  # noqa: E402

runner_calls = []
original_getitem = CompiledKernel.__getitem__
CompiledKernel.__getitem__ = lambda self, grid: runner_calls.append(grid) or original_getitem(self, grid)
hook_runner_calls = []
chain = triton.knobs.runtime.launch_enter_hook  # a HookChain from Triton 3.5 on, else None or a function
for hooked in (False, True):
    hook = lambda metadata: None  # noqa: E731
    if hooked:
        if hasattr(chain, "add"):
            chain.add(hook)
        else:
            triton.knobs.runtime.launch_enter_hook = hook
    before = len(runner_calls)
    kernels.rms_norm(x.detach(), w.detach(), impl="triton")
    hook_runner_calls.append(len(runner_calls) - before)
    if hooked:
        if hasattr(chain, "add"):
            chain.remove(hook)
        else:
            triton.knobs.runtime.launch_enter_hook = chain
json.dump({"calls": calls, "hook_runner_calls": hook_runner_calls, "layer_norm_launches": layer_norm_calls, "torch_reductions": torch_reductions,
           "misaligned_runs": misaligned_runs, "specialisations": specialisations, "launcher": type(launcher).__name__},
          sys.stdout)
