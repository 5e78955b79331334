"""Where impl="auto" runs the torch reference instead of the Triton kernel on a CUDA GPU: the
places where a measurement on that GPU class found the reference faster.

tools/benchmarks/bench_kernels.py times both on one GPU and records its verdicts in MEASURED
(--write-table rewrites this file's table, keeping other GPU classes' entries). Anything not
listed runs Triton. Keys: the GPU class, f"sm{major}{minor}-{SMs}sm" (an H100 SXM and an H200
are both sm90-132sm, and so is the H100 a dry run models, so a dry run takes the path the real
run takes), then f"{op}:{width}", with width the op's main input's last dimension rounded up to
a power of two (the kernels' tile width): the hidden size for the norms, 2f / f for SwiGLU /
bias-GeLU, the head dim for rotary, the local vocabulary for the cross-entropy.
"""

import functools

import torch

MEASURED: dict[str, dict[str, str]] = {}
# (end of the measured table)


def gpu_class(device: torch.device) -> str:
    props = torch.cuda.get_device_properties(device)
    return f"sm{props.major}{props.minor}-{props.multi_processor_count}sm"


def shape_class(op: str, width: int) -> str:
    return f"{op}:{1 << max(0, int(width) - 1).bit_length()}"


@functools.lru_cache(maxsize=None)
def _gpu_class_of(index: int | None) -> str:
    return gpu_class(torch.device("cuda", index))


def _cached_gpu_class(index: int | None) -> str:
    """gpu_class of CUDA device `index`, asked once; under torch.compile a constant of the graph
    (Dynamo calls it while tracing instead of tracing into it)."""
    return _gpu_class_of(index)


# What torch.compiler.assume_constant_result does (torch/_dynamo/decorators.py), without importing
# torch._dynamo, and with it triton, whenever megalite.kernels is imported; test_speed_table.py
# checks that a full graph still captures the lookup.
_cached_gpu_class._dynamo_marked_constant = True


def prefers_torch(op: str, x: torch.Tensor) -> bool:
    """Whether the table says the torch reference is faster for op `op` on CUDA tensor x."""
    if not MEASURED:
        return False
    verdicts = MEASURED.get(_cached_gpu_class(x.device.index), {})
    return verdicts.get(shape_class(op, x.shape[-1])) == "torch"


def render(measured: dict[str, dict[str, str]]) -> str:
    """The MEASURED assignment as it is written into this file (sorted, one entry a line)."""
    lines = ["MEASURED: dict[str, dict[str, str]] = {"]
    for gpu in sorted(measured):
        lines.append(f"    {gpu!r}: {{")
        lines += [f"        {key!r}: {impl!r}," for key, impl in sorted(measured[gpu].items())]
        lines.append("    },")
    lines.append("}")
    return "\n".join(lines) if measured else "MEASURED: dict[str, dict[str, str]] = {}"


def rewrite(path: str, gpu: str, verdicts: dict[str, str]) -> None:
    """Replace `gpu`'s entries in the table of the speed_table.py at `path` by `verdicts` (written
    to a temporary file beside it first, then moved over it whole)."""
    import ast
    import os

    with open(path, encoding="utf-8") as f:
        source = f.read()
    start = source.index("MEASURED: dict[str, dict[str, str]] = ")
    end = source.index("# (end of the measured table)")
    table = ast.literal_eval(source[start:end].split("=", 1)[1].strip())
    table[gpu] = dict(verdicts)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(source[:start] + render(table) + "\n" + source[end:])
    os.replace(tmp, path)
