"""Bytes of parameters, gradients and optimizer state on this rank, against formulas.md.

    info, line = memory_report(chunks, optimizer, pstate)
    print(line)   # at start-up

Ψ is the number of parameters of the model replica on this rank (its TP/PP shard, counted
whole even when FSDP2 shards it over DP). Buffers are counted as allocated, padding included.
Adam's moments are allocated by the first step; before it they are counted as they will be
(two fp32 values per main element; one momentum value for SGD).

Under the distributed optimizer d is the DP x CP size of one distributed-optimizer instance
(--num-distributed-optimizer-instances N: d = DP x CP / N, the N instances holding replicas),
so bf16 costs 6 + 12/d bytes per parameter.

Device and host memory are reported apart: with --optimizer-cpu-offload the optimizer's fp32
main parameters, gradient copies and moments are host memory, the weights and gradient buffers
device memory, and formulas.md (one device holding everything) does not apply.
"""

import torch

from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.data.fsdp import FSDPChunk
from megalite.parallel.state import ParallelState

_STATES_PER_ELEMENT = {"adam": 2, "sgd": 1}

# Bytes per parameter of weights, main gradients and Adam state (formulas.md):
# (plain optimizer, replicated part with the distributed optimizer, part sharded over d).
_BYTES_PER_PARAM = {
    "bf16": (18, 6, 12),
    "fp16": (20, 4, 16),
    "fp32": (16, 8, 8),
}


def bytes_per_parameter(precision: str, distributed_optimizer: bool = False,
                        data_parallel_size: int = 1) -> float:
    """Bytes of model and optimizer state per parameter on one rank: 'bf16' (bf16 weights, fp32
    main grads), 'fp16' or 'fp32', with Adam; the distributed optimizer shards the fp32 state
    over `data_parallel_size` ranks (DP x CP with context parallelism)."""
    if precision not in _BYTES_PER_PARAM:
        raise ValueError(f"precision must be one of {sorted(_BYTES_PER_PARAM)}, got {precision!r}")
    if data_parallel_size < 1:
        raise ValueError(f"data-parallel size must be positive, got {data_parallel_size}")
    plain, replicated, sharded = _BYTES_PER_PARAM[precision]
    if not distributed_optimizer:
        return float(plain)
    return replicated + sharded / data_parallel_size


def fsdp_bytes_per_parameter(data_parallel_size: int) -> float:
    """ZeRO-3 / FSDP with bf16 weights and grads and fp32 Adam state: (2 + 2 + 12) / d."""
    return 16 / data_parallel_size


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def _precision(param_dtype: torch.dtype, grad_dtype: torch.dtype) -> str | None:
    """The formulas.md row for these weight / main-gradient dtypes."""
    if grad_dtype == torch.float32:
        return {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "bf16"}.get(param_dtype)
    if param_dtype == grad_dtype == torch.float16:
        return "fp16"
    return None


def optimizer_state_bytes(optimizer) -> int:
    """fp32 main copies plus optimizer moments (as allocated, or as the first step will)."""
    total = sum(_nbytes(t) for shard in optimizer.bucket_shards for t in (shard.main_flat, shard.grad_flat)
                if t is not None)
    per_element = _STATES_PER_ELEMENT[optimizer.kind] if optimizer.kind == "adam" or \
        optimizer.inner.defaults.get("momentum") else 0
    for m in optimizer.mains:
        state = optimizer.inner.state.get(m.main)
        if state:
            total += sum(_nbytes(_local(v)) for v in state.values() if torch.is_tensor(v) and v.dim() > 0)
        else:
            total += per_element * 4 * _local(m.main).numel()
    return total


def memory_report(chunks, optimizer, pstate: ParallelState) -> tuple[dict, str]:
    """(figures, one printable line) for this rank's chunks and optimizer (host and device
    apart when the optimizer was built with cpu_offload)."""
    num_params = expert_params = param_bytes = grad_bytes = 0
    precision, fsdp = None, False
    for chunk in chunks:
        params = list(chunk.module.parameters())
        num_params += sum(p.numel() for p in params)
        expert_params += sum(p.numel() for p in params if getattr(p, "expert_parallel", False))
        if isinstance(chunk, DistributedDataParallel):
            in_buffers = set(chunk._bucket_of)
            for buffer in chunk.buffers_:
                grad_bytes += _nbytes(buffer.grad_data)
                param_bytes += _nbytes(buffer.param_data) if buffer.param_data is not None else \
                    sum(_nbytes(p) for p in buffer.bucket_of)
                precision = precision or _precision(buffer.param_dtype, buffer.grad_dtype)
            param_bytes += sum(_nbytes(p) for p in params if p not in in_buffers)
        elif isinstance(chunk, FSDPChunk):
            fsdp = True
            param_bytes += sum(_nbytes(_local(p)) for p in params)
            grad_bytes += sum(_local(p).numel() * 4 for p in params if p.requires_grad)  # fp32 reduce dtype
        else:
            raise TypeError(f"memory_report: unsupported chunk {type(chunk).__name__}")
    optimizer_bytes = optimizer_state_bytes(optimizer) if optimizer is not None else 0
    total = param_bytes + grad_bytes + optimizer_bytes
    offload = optimizer is not None and optimizer.cpu_offload
    host_bytes = optimizer_bytes if offload else 0
    # FSDP2 shards over DP x CP, the distributed optimizer over its instance's part of it
    d = pstate.dp_size * pstate.cp_size if fsdp else pstate.instance_dp_cp_size
    # expert weights shard over the expert-data-parallel group: formulas.md with d = EDP for them
    expert = pstate.expert
    edp = (expert.edp_size if fsdp else expert.edp_instance_size) if expert is not None and expert_params else d
    experts_d = f", experts d={edp}" if edp != d else ""

    def blended(per_param_at):
        return ((num_params - expert_params) * per_param_at(d) + expert_params * per_param_at(edp)) / max(num_params, 1)

    distributed = optimizer is not None and optimizer.sharded_over_dp
    if offload:
        formula, described = None, ("n/a under --optimizer-cpu-offload (formulas.md counts one device holding "
                                    "everything)")
    elif fsdp:
        formula, described = blended(fsdp_bytes_per_parameter), f"FSDP2 (2+2+12)/d, d={d}{experts_d}"
    elif precision is None or optimizer is None or optimizer.kind != "adam":
        formula, described = None, "no formula for this setup (formulas.md assumes Adam)"
    else:
        formula = blended(lambda n: bytes_per_parameter(precision, distributed, n))
        instances = f" (one of {pstate.optimizer_instances} instances)" if pstate.optimizer_instances > 1 else ""
        described = f"{precision}" + (f" + distributed optimizer, d={d}{instances}{experts_d}" if distributed else "")
    per_param = 1 / max(num_params, 1)
    info = {"rank": pstate.rank, "num_params": num_params, "expert_params": expert_params, "param_bytes": param_bytes, "grad_bytes": grad_bytes,
            "optimizer_bytes": optimizer_bytes, "total_bytes": total, "cpu_offload": offload,
            "device_bytes": total - host_bytes, "host_bytes": host_bytes,
            "bytes_per_param": total * per_param,
            "device_bytes_per_param": (total - host_bytes) * per_param, "host_bytes_per_param": host_bytes * per_param,
            "optimizer_bytes_per_param": optimizer_bytes * per_param,
            "formula_bytes_per_param": formula, "formula": described}
    experts = f" ({expert_params / 1e6:.2f}M in this rank's experts)" if expert_params else ""
    head = f"memory (rank {pstate.rank}): {num_params / 1e6:.2f}M params{experts} | "
    if offload:
        line = (head + f"device ({optimizer.comm_device.type}): weights {_fmt(param_bytes)} + grads "
                f"{_fmt(grad_bytes)} = {_fmt(total - host_bytes)} = {info['device_bytes_per_param']:.2f} B/param | "
                f"host (cpu): optimizer {_fmt(host_bytes)} = {info['host_bytes_per_param']:.2f} B/param | "
                f"formula {described}")
    else:
        line = (head + f"weights {_fmt(param_bytes)} + grads {_fmt(grad_bytes)} + optimizer {_fmt(optimizer_bytes)} "
                f"= {_fmt(total)} = {info['bytes_per_param']:.2f} B/param | formula {described}: "
                + (f"{formula:.2f} B/param" if formula is not None else "n/a"))
    return info, line


def _fmt(n: int) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
