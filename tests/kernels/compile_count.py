"""The Triton compilations the kernel tests would cost on a GPU, counted on the CPU.

A compiled run (TRITON_INTERPRET=0) compiles a kernel once per specialisation: its constexpr
arguments and num_warps, each tensor argument's dtype and whether its address is a multiple of
16, each int's being 1, a multiple of 16 or 64-bit wide (what JITFunction.run keys its cache on,
as triton_common.DirectLauncher does). Loaded into an interpreted run, this plugin records that
key for every launch and writes, per test, the keys the test launched:

    TRITON_INTERPRET=1 python -m pytest -p tests.kernels.compile_count --compile-count FILE tests/kernels ...
    python -m tests.kernels.compile_count FILE      # distinct compilations, and per test file

(the addresses are the CPU allocator's, whose alignment, like CUDA's, exceeds 16 bytes for
whole tensors: the few views at odd offsets are the same on both). How the CUDA tests are kept
to few compilations: tests/kernels/README.md.
"""

import json
import sys
from collections import defaultdict

import pytest


def specialisation(name: str, arg_names: list[str], args: tuple, kwargs: dict) -> str:
    """The compile key of one launch of kernel `name`, as a string."""
    import torch

    parts = [name]
    for arg_name, value in zip(arg_names, args):
        if isinstance(value, torch.Tensor):
            parts.append(f"{arg_name}:{value.dtype}:{value.data_ptr() % 16 == 0}")
        elif isinstance(value, bool) or value is None:
            parts.append(f"{arg_name}={value}")
        elif isinstance(value, int):
            parts.append(f"{arg_name}:{'1' if value == 1 else value % 16 == 0}:{not -2**31 <= value < 2**31}")
        elif isinstance(value, float):
            parts.append(f"{arg_name}:float")
        else:
            parts.append(f"{arg_name}={value!r}")
    parts += [f"{k}={v!r}" for k, v in sorted(kwargs.items())]
    return " ".join(parts)


class CompileCounter:
    def __init__(self, path: str):
        self.path = path
        self.current = None
        self.keys = defaultdict(set)  # test node id -> keys

    def install(self) -> None:
        from triton.runtime.interpreter import InterpretedFunction

        original = InterpretedFunction.run
        counter = self

        def run(kernel, *args, grid, warmup, **kwargs):
            if counter.current is not None and not warmup:
                key = specialisation(kernel.fn.__name__, kernel.arg_names, args, kwargs)
                counter.keys[counter.current].add(key)
            return original(kernel, *args, grid=grid, warmup=warmup, **kwargs)
        InterpretedFunction.run = run

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(self, item, nextitem):
        self.current = item.nodeid
        yield
        self.current = None

    def pytest_sessionfinish(self, session):
        with open(self.path, "w") as f:
            json.dump({test: sorted(keys) for test, keys in self.keys.items()}, f, indent=0)


def pytest_addoption(parser):
    parser.addoption("--compile-count", metavar="FILE", help="write each test's Triton compile keys here (JSON)")


def pytest_configure(config):
    path = config.getoption("--compile-count")
    if path:
        counter = CompileCounter(path)
        counter.install()
        config.pluginmanager.register(counter, "compile-counter")


def summary(per_test: dict[str, list[str]]) -> dict:
    """{'distinct': compilations of the whole run, 'files': {file: (tests, compilations it alone
    needs, compilations it needs)}}: what a run compiles once, and what each file costs."""
    by_file = defaultdict(set)
    tests = defaultdict(int)
    for test, keys in per_test.items():
        path = test.split("::")[0]
        by_file[path] |= set(keys)
        tests[path] += 1
    everything = set().union(*by_file.values()) if by_file else set()
    files = {}
    for path, keys in by_file.items():
        others = set().union(*(v for p, v in by_file.items() if p != path))
        files[path] = (tests[path], len(keys - others), len(keys))
    return {"distinct": len(everything), "files": dict(sorted(files.items(), key=lambda kv: -kv[1][2]))}


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        result = summary(json.load(f))
    print(f"distinct compilations: {result['distinct']}")
    print(f"{'file':60} {'tests':>5} {'own':>5} {'needs':>5}")
    for path, (n, own, needs) in result["files"].items():
        print(f"{path:60} {n:>5} {own:>5} {needs:>5}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
