"""Choosing between a Triton kernel and its plain-torch reference.

Every public op in megalite.kernels takes ``impl``:

- ``"torch"``: the reference, plain torch, any device;
- ``"triton"``: the Triton kernel; CUDA tensors, or CPU tensors when the process runs Triton's
  interpreter (TRITON_INTERPRET=1 set before megalite's Triton modules are first imported);
- ``"auto"``: Triton when every tensor is on CUDA and triton imports, unless the measured table
  (speed_table.py) says the reference is faster for this GPU and shape; else torch.

Nothing here imports triton at module import: the Triton modules are imported on first use.
These checks run on every call of an op, so they are kept to a few attribute reads.
"""

import importlib
import sys

import torch

from megalite.kernels import speed_table

IMPLS = ("auto", "triton", "torch")


def on_real_cuda(t: torch.Tensor) -> bool:
    """True for a CUDA tensor that is not fake (the dry run's fake CUDA runs no kernel, no copy
    stream: it takes the CPU-side paths)."""
    return t.is_cuda and not isinstance(t, torch._subclasses.fake_tensor.FakeTensor)


def triton_importable() -> bool:
    """True when `import triton` succeeds (after the first import, a sys.modules lookup)."""
    if "triton.language" in sys.modules:
        return sys.modules["triton.language"] is not None
    try:
        importlib.import_module("triton.language")
    except Exception:  # noqa: BLE001 - ImportError, or a broken install failing at import
        return False
    return True


def use_triton(op: str, impl: str, *tensors: torch.Tensor | None) -> bool:
    """Resolve ``impl`` for op `op` on `tensors` (None entries ignored; the first is the op's main
    input, whose last dim is its shape class in the measured table) to Triton (True) or torch."""
    if impl == "torch":
        return False
    if impl == "auto":
        for t in tensors:
            if t is not None and not t.is_cuda:
                return False
        if speed_table.prefers_torch(op, tensors[0]):
            return False
    elif impl != "triton":
        raise ValueError(f"{op}: impl must be one of {IMPLS}, got {impl!r}")
    if torch.compiler.is_compiling():
        # Dynamo cannot trace an import; compiling CUDA code needs triton anyway (inductor), and
        # the import is checked when the same code runs eagerly.
        return True
    if not triton_importable():
        if impl == "triton":
            raise RuntimeError(f"{op}: impl='triton' but `import triton` fails on this machine; use impl='auto' or 'torch'")
        return False
    return True


def check_triton_device(op: str, *tensors: torch.Tensor | None) -> None:
    """Raise a clear error when a Triton kernel cannot run on these tensors."""
    index = tensors[0].get_device()
    if all(t is None or (t.is_cuda and t.get_device() == index) for t in tensors):
        return  # the common case, in a few attribute reads
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{op}: tensors on different devices {sorted(map(str, devices))}")
    device = devices.pop()
    from megalite.kernels import triton_common

    if device.type == "cpu" and triton_common.INTERPRETED:
        return
    raise ValueError(f"{op}: impl='triton' needs CUDA tensors (got {device}); CPU tensors run only under "
                     "Triton's interpreter, with TRITON_INTERPRET=1 set before megalite's Triton kernels are "
                     "first imported")


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last dim] with unit stride along the last dim (t itself or a view when possible)."""
    if t.dim() == 2 and t.stride(-1) == 1:
        return t  # the common case, without creating a view
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()


def rows_of(t: torch.Tensor) -> tuple[torch.Tensor, int, int]:
    """(t or a [rows, h] copy of it, rows, row stride): t itself when contiguous (its rows then lie
    h apart with unit stride along h, the kernels' layout, whatever its leading dims), else as_rows(t)."""
    n_cols = t.shape[-1]
    if t.is_contiguous():
        return t, t.numel() // n_cols, n_cols
    t2d = as_rows(t)
    return t2d, t2d.shape[0], t2d.stride(0)
