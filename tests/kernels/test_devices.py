"""The kernel tests run on the device the `device` fixture gives: the CPU under the interpreter,
the GPU with compiled kernels. On a GPU machine with TRITON_INTERPRET=0 a test that built CPU
tensors for a kernel failed ("needs CUDA tensors (got cpu)"); these checks catch that class on
this GPU-less machine."""

import ast
from pathlib import Path

import pytest

from tests.kernels.devices import kernel_device

HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("interpreted, cuda, expected", [(True, False, "cpu"), (True, True, "cpu"),
                                                         (False, True, "cuda"), (False, False, None)])
def test_fixture_device_for_each_machine(interpreted, cuda, expected):
    assert kernel_device(interpreted, cuda) == expected


def _runs_a_kernel(function: ast.FunctionDef) -> bool:
    """A call with impl="triton" (a dict() literal aside), torch.library.opcheck, or an import of a
    megalite *_triton module."""
    for node in ast.walk(function):
        if isinstance(node, ast.Call) and not (isinstance(node.func, ast.Name) and node.func.id == "dict") and any(
                k.arg == "impl" and getattr(k.value, "value", None) == "triton" for k in node.keywords):
            return True
        if isinstance(node, ast.Attribute) and node.attr == "opcheck":
            return True
        if isinstance(node, ast.ImportFrom) and any(a.name.endswith("_triton") for a in node.names):
            return True
    return False


def test_every_kernel_test_takes_the_device_fixture():
    """A test function that runs a kernel takes `device` (directly, or through a helper it passes
    it to): its tensors then live where the kernels run, CPU or GPU."""
    missing = []
    for path in sorted(HERE.glob("test_*.py")):
        tree = ast.parse(path.read_text())
        for function in tree.body:
            if not isinstance(function, ast.FunctionDef) or not function.name.startswith("test_"):
                continue
            helpers = {n.func.id for n in ast.walk(function) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)}
            bodies = [function] + [f for f in tree.body if isinstance(f, ast.FunctionDef) and f.name in helpers]
            if any(_runs_a_kernel(f) for f in bodies) and "device" not in [a.arg for a in function.args.args]:
                missing.append(f"{path.name}::{function.name}")
    assert not missing, f"tests running kernels without the device fixture: {missing}"
