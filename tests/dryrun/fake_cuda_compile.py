"""Run by test_fake_cuda.py in a process with the fake CUDA device (the shim preloaded, compiled
Triton, not the interpreter): a whole GPTModel in bf16 on fake CUDA tensors under
torch.compile(fullgraph=True) with AOTAutograd (aot_eager), forward and backward. fullgraph=True
raises at the first graph break; the JSON printed says which megalite kernels ended up in the
forward and backward graphs, and where the outputs live."""

import json
import re
import sys

import torch
from torch._dynamo.utils import counters
from torch._subclasses.fake_tensor import FakeTensorMode

from megalite.dryrun.fake_cuda import exit_now
from megalite.dryrun.gpu_attention import GpuAttention
from megalite.model.gpt import GPTModel
from megalite.model.meta_init import materialize_
from tests.model.test_gpt_tp import make_config
from tests.model.test_model_torch_compile import RecordingBackend


def run(family: str) -> dict:
    torch._dynamo.reset()
    counters.clear()
    config = make_config(family, params_dtype="bfloat16")
    recorder = RecordingBackend()
    with FakeTensorMode(), GpuAttention():
        model = GPTModel(config, device="meta")
        materialize_(model, torch.device("cuda"), init=False)
        model.compile(backend=recorder.backend, fullgraph=True)
        tokens = torch.randint(0, config.vocab_size, (2, 16), device="cuda")
        losses = model(tokens, labels=tokens)
        losses.float().mean().backward()
        grads = {p.grad.device.type for p in model.parameters()}
    kernels = {kind: sorted(set(re.findall(r"megalite_kernels\.(\w+)\.default", recorder.code(kind))))
               for kind in ("forward", "backward")}
    return {"graph_breaks": sum(counters["graph_break"].values()),
            "graphs": [len(recorder.graphs["forward"]), len(recorder.graphs["backward"])],
            "kernels": kernels, "loss": [str(losses.dtype), str(losses.device)], "grad_devices": sorted(grads)}


if __name__ == "__main__":
    json.dump({family: run(family) for family in sys.argv[1:]}, sys.stdout)
    exit_now(0)
