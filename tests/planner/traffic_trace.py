"""The bytes one training step of megalite's GPU code path moves, by the planner's kernel
classes: megalite's dry run (one rank, fake CUDA: the Triton ops' fake kernels, flash
attention, the DDP gradient accumulation, the optimizer) under a dispatch mode that counts what
every operator reads and writes. The test of gpu_kernels.py's traffic model runs it as

    python tests/planner/traffic_trace.py PRETRAIN_GPT_FLAGS...

and reads one JSON object: {class: [forward bytes, backward bytes]}, with 'gemm', 'attention'
and 'optimizer' kept apart (the planner times them otherwise). Views cost nothing; an in-place
op reads its inputs and writes its first; a copy reads its source and writes its destination;
a fill writes; gather and scatter move the index's worth of elements.
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from megalite.dryrun.fake_cuda import exit_now, fake_cuda_ready, reexec_with_fake_cuda  # noqa: E402

FREE = {"view", "_unsafe_view", "reshape", "transpose", "t", "permute", "expand", "slice", "select", "detach",
        "alias", "as_strided", "unsqueeze", "squeeze", "split", "split_with_sizes", "unbind", "narrow", "empty",
        "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_reshape_alias", "lift_fresh", "unflatten",
        "flatten", "view_as", "expand_as", "diagonal", "set_", "resize_", "_local_scalar_dense", "is_same_size",
        "_has_compatible_shallow_copy_type", "record_stream"}
FILLS = {"zeros", "zero_", "fill_", "ones", "full", "new_zeros", "zeros_like", "full_like", "ones_like", "new_full"}
MEGALITE = {"norm": "norm", "swiglu": "swiglu", "bias": "bias_gelu", "rotary": "rotary", "ce": "cross_entropy",
            "cross": "cross_entropy"}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def op_class(namespace: str, name: str, phase: str) -> str:
    if phase == "opt":
        return "optimizer"
    if namespace == "megalite_kernels":
        return MEGALITE[name.split("_")[0]]
    if name in ("mm", "addmm", "bmm", "baddbmm"):
        return "gemm"
    if "attention" in name:
        return "attention"
    return "torch"


def moved_bytes(func, args, kwargs, out) -> int | None:
    """Bytes operator `func` reads and writes (None: a view or an allocation, no kernel)."""
    import torch
    from torch.utils._pytree import tree_flatten

    namespace, name = func._schema.name.split("::")[0], func.__name__.split(".")[0]
    if namespace == "prim" or (namespace == "aten" and name in FREE):
        return None
    flat = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
    outs = [a for a in tree_flatten(out)[0] if isinstance(a, torch.Tensor)]
    if name in FILLS:
        return _nbytes(outs)
    if name == "copy_":
        return 2 * _nbytes(flat[1:2]) if flat[0].dtype == flat[1].dtype else _nbytes(flat[:2])
    if name == "embedding":  # reads the looked-up rows
        return 2 * _nbytes(outs)
    if name in ("gather", "scatter_add_", "scatter_", "index_select"):
        index = next(a for a in flat if not a.is_floating_point())
        return 2 * index.numel() * flat[0].element_size()
    if name.startswith("_foreach_") or name.startswith("_fused_"):
        lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
        written = 3 if name.startswith("_fused_adam") else 1 if name.endswith("_") else 0
        moved = sum(_nbytes(lst) for lst in lists) + sum(_nbytes(lst) for lst in lists[:written])
        return moved + (0 if name.endswith("_") else _nbytes(outs))
    if name == "cross_entropy_loss":  # takes the logits for autograd, reads the row statistics
        return _nbytes(flat[1:]) + _nbytes(outs)
    if name.endswith("_"):
        return _nbytes(flat) + _nbytes(flat[:1])
    return _nbytes(flat) + _nbytes(outs)


def main(argv: list[str]) -> int:
    import torch

    import megalite.dryrun.runner as runner
    from megalite.optimizer.mixed_precision import MixedPrecisionOptimizer
    from megalite.config.arguments import parse_args, validate_args
    from megalite.config.megatron.model import tokenizer_from_args

    traffic, phase = {}, ["step"]

    class Counting(runner.StepMemTracker):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = super().__torch_dispatch__(func, types, args, kwargs)
            moved = moved_bytes(func, args, kwargs, out)
            if moved is not None:
                kind = op_class(func._schema.name.split("::")[0], func.__name__.split(".")[0], phase[0])
                traffic.setdefault(kind, [0, 0])[1 if self._mod_tracker.is_bw else 0] += moved
            return out

    def in_phase(method, name):
        def wrapped(self, *args, **kwargs):
            phase[0] = name
            try:
                return method(self, *args, **kwargs)
            finally:
                phase[0] = "step"
        return wrapped

    runner.StepMemTracker = Counting
    MixedPrecisionOptimizer.step = in_phase(MixedPrecisionOptimizer.step, "opt")
    MixedPrecisionOptimizer.zero_grad = in_phase(MixedPrecisionOptimizer.zero_grad, "opt")
    args = parse_args(argv + ["--lr", "1e-4", "--train-iters", "1", "--mock-data"])
    validate_args(args, 1)
    runner.run_rank(args, tokenizer_from_args(args).vocab_size, 0, 1, torch.device("cuda"))
    print(json.dumps(traffic), flush=True)
    return 0


if __name__ == "__main__":
    if not fake_cuda_ready():
        reexec_with_fake_cuda([__file__, *sys.argv[1:]])
    exit_now(main(sys.argv[1:]))
