"""Choosing between a Triton kernel and its plain-torch reference.

Every public op in megalite.kernels takes ``impl``:

- ``"torch"``: the reference, plain torch, any device;
- ``"triton"``: the Triton kernel; CUDA tensors, or CPU tensors when the process runs Triton's
  interpreter (TRITON_INTERPRET=1 set before megalite's Triton modules are first imported);
- ``"auto"``: Triton when every tensor is on CUDA and triton imports, else torch.

Nothing here imports triton at module import: the Triton modules are imported on first use.
"""

import importlib

import torch

IMPLS = ("auto", "triton", "torch")


def triton_importable() -> bool:
    """True when `import triton` succeeds (after the first import, a sys.modules lookup)."""
    try:
        importlib.import_module("triton.language")
    except Exception:  # noqa: BLE001 - ImportError, or a broken install failing at import
        return False
    return True


def use_triton(op: str, impl: str, *tensors: torch.Tensor | None) -> bool:
    """Resolve ``impl`` for op `op` on `tensors` (None entries ignored) to Triton (True) or torch."""
    if impl == "torch":
        return False
    if impl == "auto":
        if not all(t.is_cuda for t in tensors if t is not None):
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
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"{op}: tensors on different devices {sorted(map(str, devices))}")
    device = devices.pop()
    if device.type == "cuda":
        return
    from megalite.kernels import triton_common

    if device.type == "cpu" and triton_common.INTERPRETED:
        return
    raise ValueError(f"{op}: impl='triton' needs CUDA tensors (got {device}); CPU tensors run only under "
                     "Triton's interpreter, with TRITON_INTERPRET=1 set before megalite's Triton kernels are "
                     "first imported")


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t as [rows, last dim] with unit stride along the last dim (a view when possible)."""
    t2d = t.reshape(-1, t.shape[-1])
    return t2d if t2d.stride(-1) == 1 else t2d.contiguous()
