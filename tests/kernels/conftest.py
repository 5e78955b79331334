"""Kernel tests run every Triton kernel under Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton decorates a kernel: megalite imports its Triton
modules lazily (on the first impl='triton' call), and conftest files are imported at collection,
before any test runs, so setting it here is early enough even when the whole suite shares one
pytest process. Other test areas may have imported triton.language already (megatron.core does),
whose own @jit helpers (tl.sum, tl.sigmoid, ...) are then compiled-mode functions the interpreter
cannot call; megalite's kernels use only builtins and helpers of their own for that reason
(triton_common.py; test_dispatch.py checks it). Spawned processes (the TP=2 test) inherit the
variable through the environment.

With TRITON_INTERPRET=0 and a GPU, the same tests run the compiled kernels on CUDA instead.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def device() -> str:
    """Where impl='triton' runs: the CPU under the interpreter, else the GPU. Every test that runs
    a kernel builds its tensors here (test_devices.py checks that they take this fixture)."""
    pytest.importorskip("triton")
    from megalite.kernels.triton_common import interpreter_enabled
    from tests.kernels.devices import kernel_device

    found = kernel_device(interpreter_enabled(), torch.cuda.is_available())
    if found is None:
        pytest.skip("Triton kernels are compiled (TRITON_INTERPRET is not 1) and there is no GPU to run them")
    return found
