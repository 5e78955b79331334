"""Adam on CUDA (skipped without a GPU): torch's fused AdamW with the model on the GPU, and under
--optimizer-cpu-offload torch's foreach AdamW on the CPU, where the fp32 main parameters, Adam's
moments and the fp32 gradient copies live while the model and its gradient buffers stay on the
GPU. The CPU side (foreach) is in test_optimizer.py."""

import math

import pytest
import torch

from megalite.model.gpt import masked_mean_loss
from megalite.optimizer.memory_report import memory_report
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel.data.ddp import DistributedDataParallel, finalize_model_grads
from megalite.parallel.state import ParallelState
from tests.model.test_gpt_tp import make_config
from tests.parallel.data.test_data_parallel import OPTIM, make_model, micro_batches

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SINGLE = ParallelState.single()
CUDA = torch.device("cuda")


def _build(cpu_offload: bool):
    model = make_model(make_config("gpt2", params_dtype="bfloat16", fused_kernels=False), SINGLE, device=CUDA)
    chunk = DistributedDataParallel(model, SINGLE, use_distributed_optimizer=cpu_offload)
    optimizer = build_optimizer([chunk], SINGLE, bf16=True, use_distributed_optimizer=cpu_offload,
                                cpu_offload=cpu_offload, **OPTIM)
    return chunk, optimizer


def _train(chunk, optimizer, steps: int = 2) -> None:
    initial = [p.detach().clone() for p in chunk.module.parameters()]
    for step in range(steps):
        optimizer.zero_grad()
        tokens, labels, mask = (t.to(CUDA) for t in micro_batches(step, 0, 1, 8)[0])
        masked_mean_loss(chunk(tokens, labels=labels), mask).backward()
        finalize_model_grads([chunk], SINGLE)
        ok, norm, _ = optimizer.step()
        assert ok and math.isfinite(norm), (step, norm)
    assert all(torch.isfinite(p).all() for p in chunk.module.parameters())
    moved = [not torch.equal(a, p) for a, p in zip(initial, chunk.module.parameters())]
    assert sum(moved) > len(moved) // 2, "the steps left most parameters unchanged"


def _state_devices(optimizer) -> set:
    return {t.device.type for state in optimizer.inner.state.values() for key, t in state.items()
            if key in ("exp_avg", "exp_avg_sq")}


def test_adam_is_fused_on_cuda():
    chunk, optimizer = _build(cpu_offload=False)
    assert optimizer.inner.defaults["fused"] is True and not optimizer.inner.defaults.get("foreach")
    _train(chunk, optimizer)
    assert {m.main.device.type for m in optimizer.mains} == {"cuda"}
    assert _state_devices(optimizer) == {"cuda"}


def test_cpu_offload_keeps_main_params_adam_state_and_gradient_copies_on_the_cpu():
    chunk, optimizer = _build(cpu_offload=True)
    defaults = optimizer.inner.defaults
    assert defaults["foreach"] is True and not defaults.get("fused"), defaults
    _train(chunk, optimizer)
    assert {p.device.type for p in chunk.module.parameters()} == {"cuda"}
    assert {t.device.type for b in chunk.buffers_ for t in (b.grad_data, b.param_data)} == {"cuda"}
    assert {m.main.device.type for m in optimizer.mains} == {"cpu"}
    assert {m.main.grad.device.type for m in optimizer.mains} == {"cpu"}
    assert {t.device.type for s in optimizer.bucket_shards for t in (s.main_flat, s.grad_flat)} == {"cpu"}
    assert _state_devices(optimizer) == {"cpu"}
    # The report asks the optimizer whether it offloads (optimizer.cpu_offload).
    info, line = memory_report([chunk], optimizer, SINGLE)
    assert info["cpu_offload"] and info["formula_bytes_per_param"] is None, line
    assert abs(info["device_bytes_per_param"] / 6 - 1) < 0.01, line
    assert abs(info["host_bytes_per_param"] / 16 - 1) < 0.01, line
