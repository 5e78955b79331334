"""Run by test_fake_cuda.py in a process with the fake CUDA device (the shim preloaded, compiled
Triton, not the interpreter): a GPTModel in bf16 on fake CUDA tensors compiled as --torch-compile
compiles it (GPTModel.compile_regions: the embedding, each layer, the head with its loss), each
region with fullgraph=True and AOTAutograd (aot_eager), forward and backward. fullgraph=True
raises at the first graph break. Cases: each family at TP = 1 with the Triton cross-entropy
(--cross-entropy-loss-fusion) and with the reference loss, and at TP = 2 with sequence
parallelism on a fake process group (rank 0 of 2: collectives trace, nothing is sent). The JSON
printed says, per case, how many graphs each way, which megalite kernels ended up in the forward
and backward graphs, and where the outputs live."""

import json
import re
import sys

import torch
import torch.distributed as dist
from torch._dynamo.utils import counters
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.testing._internal.distributed.fake_pg import FakeStore

from megalite.dryrun.fake_cuda import exit_now
from megalite.dryrun.gpu_attention import GpuAttention
from megalite.model.gpt import GPTModel
from megalite.model.meta_init import materialize_
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.model.compile_recording import RecordingBackend
from tests.model.test_gpt_tp import make_config

CASES = {"tp1": dict(), "tp1-reference-loss": dict(unfused_kernels=("cross_entropy",)),
         "tp2-sp": dict(sequence_parallel=True)}


class Sm90Driver:
    """What torch asks Triton's active driver for while it traces a user-defined kernel (which of
    its arguments the kernel writes, found from the kernel's TTIR), on a machine without a GPU:
    an H100's target. Without it torch assumes every argument is written, which a GPU never
    makes it assume."""

    def get_current_target(self):
        from triton.backends.compiler import GPUTarget

        return GPUTarget("cuda", 90, 32)


def triton_kernels(code: str) -> set[str]:
    """The Triton kernels a graph launches as user-defined kernels (inductor compiles them)."""
    names = set()
    for index in set(re.findall(r"kernel_idx = (\d+)", code)):
        kernel = kernel_side_table.get_kernel(int(index))
        while hasattr(kernel, "fn"):  # Autotuner -> JITFunction -> the Python function
            kernel = kernel.fn
        names.add(kernel.__name__)
    return names


def run(family: str, case: str) -> dict:
    torch._dynamo.reset()
    counters.clear()
    config = make_config(family, params_dtype="bfloat16", **CASES[case])
    state = ParallelState.create(ParallelLayout(2, tensor=2)) if case.startswith("tp2") else None
    recorder = RecordingBackend()
    with FakeTensorMode(), GpuAttention():
        model = GPTModel(config, state, device="meta")
        materialize_(model, torch.device("cuda"), init=False)
        model.compile_regions(backend=recorder.backend, fullgraph=True)
        tokens = torch.randint(0, config.vocab_size, (2, 16), device="cuda")
        losses = model(tokens, labels=tokens)
        losses.float().mean().backward()
        grads = {p.grad.device.type for p in model.parameters()}
    kernels = {kind: sorted(set(re.findall(r"megalite_kernels\.(\w+)\.default", recorder.code(kind)))
                            | triton_kernels(recorder.code(kind))) for kind in ("forward", "backward")}
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "graphs": [len(recorder.graphs["forward"]), len(recorder.graphs["backward"])],
            "kernels": kernels, "loss": [str(losses.dtype), str(losses.device)], "grad_devices": sorted(grads),
            "collectives": sorted(set(re.findall(r"_c10d_functional\.(\w+)\.default", recorder.code("forward")
                                                 + recorder.code("backward"))))}


if __name__ == "__main__":
    import triton

    triton.runtime.driver.set_active(Sm90Driver())
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    # arguments: FAMILY/CASE, e.g. gpt2/tp2-sp
    json.dump({name: run(*name.split("/")) for name in sys.argv[1:]}, sys.stdout)
    exit_now(0)
