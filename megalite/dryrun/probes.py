"""What a dry run watches while one rank's training iteration runs on fake tensors.

- `CommCounter`: bytes each process group moves (collectives and pipeline sends/receives),
  counted from the c10d ops' tensors, as the payload one rank hands to the group.
- `MixCheck`: stops at the first op whose tensor inputs sit on different devices or mix
  floating dtypes where the op requires one (naming the op, the module running and the
  tensors), so a CUDA run's device or dtype mistake is found without a GPU.
- `ScalarReads`: a fake tensor has no value; `.item()` on one answers 1 (Adam's step count on
  its first step, a gradient norm of 1: no clipping). The fp16 inf check, which would read 1 as
  "inf found", is answered by the runner.
"""

from collections import defaultdict

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

_COLLECTIVES = {
    "allreduce_": "all-reduce", "allreduce_coalesced_": "all-reduce", "_allgather_base_": "all-gather",
    "allgather_": "all-gather", "allgather_into_tensor_coalesced_": "all-gather",
    "_reduce_scatter_base_": "reduce-scatter", "reduce_scatter_": "reduce-scatter",
    "reduce_scatter_tensor_coalesced_": "reduce-scatter", "broadcast_": "broadcast",
    "send": "send", "recv_": "recv", "alltoall_base_": "all-to-all", "reduce_": "reduce",
}


class CommCounter(TorchDispatchMode):
    """Per process group (named by `names`: group -> 'tp', 'dp', ...) and kind, the bytes of this
    rank's contribution (all-reduce and broadcast: the tensor; all-gather: its input shard;
    reduce-scatter and all-to-all: its full input; send / recv: the message) and the number of calls."""

    def __init__(self, names: dict):
        super().__init__()
        self.names = {g: n for g, n in names.items() if g is not None}
        self.bytes = defaultdict(int)
        self.calls = defaultdict(int)

    def _group_name(self, func, args) -> str:
        for arg, value in zip(func._schema.arguments, args):
            if arg.name == "process_group":
                group = dist.ProcessGroup.unbox(value) if isinstance(value, torch.ScriptObject) else value
                return next((n for g, n in self.names.items() if g is group), "other")
        return "other"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kind = _COLLECTIVES.get(func._schema.name.split("::")[-1]) if func.namespace == "c10d" else None
        if kind is not None:
            named = {a.name: v for a, v in zip(func._schema.arguments, args)}
            payload = next(named[n] for n in ("input_tensor", "input_tensors", "tensors", "input") if n in named)
            key = (self._group_name(func, args), kind)
            self.bytes[key] += sum(t.numel() * t.element_size() for t in tree_flatten(payload)[0]
                                   if isinstance(t, torch.Tensor))
            self.calls[key] += 1
        return func(*args, **(kwargs or {}))


class MixedTensorsError(RuntimeError):
    pass


class MixCheck(TorchDispatchMode):
    """Raise MixedTensorsError at an op whose tensors are on different devices (CPU scalars
    aside), or at a matmul whose operands differ in dtype."""

    def __init__(self, module_stack):
        super().__init__()
        self.module_stack = module_stack  # callable: the module path running now

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        devices = {t.device for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        name = func._schema.name.split("::")[-1]
        problem = None
        if len(devices) > 1 and func.namespace not in ("c10d",) and name not in ("_to_copy", "copy_", "to"):
            problem = "devices " + ", ".join(sorted(map(str, devices)))
        elif name in ("mm", "addmm", "bmm", "matmul", "linear", "baddbmm", "addmm_"):
            dtypes = {t.dtype for t in tensors}
            if func._overloadname in ("dtype", "dtype_out"):  # 16-bit operands, an out_dtype result
                dtypes = _out_dtype_mix(name, args, kwargs or {})
            if len(dtypes) > 1:
                problem = "dtypes " + ", ".join(sorted(map(str, dtypes)))
        if problem:
            shapes = ", ".join(f"{tuple(t.shape)} {t.dtype} on {t.device}" for t in tensors)
            raise MixedTensorsError(f"{func} in module {self.module_stack() or '(no module)'} mixes {problem}: "
                                    f"tensors {shapes}")
        return func(*args, **(kwargs or {}))


def _out_dtype_mix(name: str, args, kwargs) -> set:
    """The dtypes an out_dtype matmul overload (torch.mm / addmm / bmm / baddbmm with
    out_dtype, gradient accumulation fusion's fp32 weight-gradient GEMM) must agree on: its two
    operands' dtype, and out_dtype for the accumulated input and the output, told apart."""
    accumulating = name in ("addmm", "baddbmm")  # (self, mat1, mat2, out_dtype), else (self, mat2, out_dtype)
    operands, out_dtype = (args[1:3], args[3]) if accumulating else (args[0:2], args[2])
    accumulators = [t for t in [args[0] if accumulating else None, kwargs.get("out")] if isinstance(t, torch.Tensor)]
    dtypes = {t.dtype for t in operands}
    if any(t.dtype != out_dtype for t in accumulators):
        return dtypes | {t.dtype for t in accumulators} | {f"out_dtype {out_dtype}"}
    return dtypes


class ScalarReads(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            t = args[0]
            return True if t.dtype == torch.bool else 1 if not t.is_floating_point() else 1.0
        return func(*args, **(kwargs or {}))
