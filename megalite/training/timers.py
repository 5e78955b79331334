"""--timing-log-level 1: wall-clock time of each phase of an iteration, reported every
--log-interval as Megatron reports it, the (min, max) over ranks of the milliseconds per
iteration:

    (min, max) time across ranks (ms):
        forward-backward ...............................: (812.31, 815.02)
        optimizer ......................................: (10.41, 10.77)

    timers = Timers(level, device)
    with timers("forward-backward"):
        ...
    text = timers.report(world_group, iterations)   # a collective: every rank calls it

At level 0 the timers cost nothing (no device synchronisation). At level 1 each timed phase
ends with a device synchronisation, so a CUDA phase is timed when it finished, not when it
was queued.
"""

import contextlib
import time

import torch
import torch.distributed as dist

from megalite.parallel.comm import group_size

PHASES = ("forward-backward", "grads-sync", "optimizer", "evaluation", "save-checkpoint")
"""Timed phases in report order (Megatron's names where it has them: forward-backward,
optimizer, save-checkpoint; grads-sync is finalize_model_grads: the data-parallel reduction
and the embedding / norm gradient all-reduces)."""


class Timers:
    def __init__(self, level: int, device: torch.device):
        self.level, self.device = level, device
        self.elapsed = dict.fromkeys(PHASES, 0.0)

    def _synchronize(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def __call__(self, phase: str):
        if not self.level:
            yield
            return
        if phase not in self.elapsed:
            raise KeyError(f"unknown timer {phase!r}; known: {', '.join(PHASES)}")
        self._synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            self._synchronize()
            self.elapsed[phase] += time.perf_counter() - start

    def report(self, group, iterations: int) -> str | None:
        """The timing block for the last `iterations` iterations (None at level 0), and the
        timers restarted. Phases no rank ran are left out. A collective over `group`."""
        if not self.level:
            return None
        ms = torch.tensor([self.elapsed[p] * 1000 / max(iterations, 1) for p in PHASES], dtype=torch.float64,
                          device=self.device)
        extremes = torch.cat([-ms, ms])  # one MAX all-reduce gives both: min(x) = -max(-x)
        if group_size(group) > 1:
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
        self.elapsed = dict.fromkeys(PHASES, 0.0)
        negated_low, high = extremes.view(2, -1).tolist()
        lines = ["(min, max) time across ranks (ms):"]
        for phase, a, b in zip(PHASES, negated_low, high):
            if b > 0:
                lines.append(f"    {phase + ' ':.<48}: ({-a:.2f}, {b:.2f})")
        return "\n".join(lines)
