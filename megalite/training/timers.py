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
    def __init__(self, level: int, device: torch.device, option: str = "minmax"):
        """`option` (--timing-log-option): max, minmax (both over ranks) or all (every rank)."""
        if option not in ("max", "minmax", "all"):
            raise ValueError(f"--timing-log-option must be max, minmax or all, got {option!r}")
        self.level, self.device, self.option = level, device, option
        self.elapsed = dict.fromkeys(PHASES, 0.0)
        self.last_max_ms: dict[str, float] = {}  # the last report's maximum over ranks, per phase

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
        self.elapsed = dict.fromkeys(PHASES, 0.0)
        world = group_size(group)
        if self.option == "all":
            ranks = [torch.empty_like(ms) for _ in range(world)] if world > 1 else [ms]
            if world > 1:
                dist.all_gather(ranks, ms, group=group)
            table = torch.stack(ranks).tolist()
            self.last_max_ms = {p: max(row[i] for row in table) for i, p in enumerate(PHASES)}
            lines = ["times across ranks (ms):"]
            for i, phase in enumerate(PHASES):
                if any(row[i] > 0 for row in table):
                    lines.append(f"  {phase}:")
                    lines += [f"     rank {r:2d}: {row[i]:.2f}" for r, row in enumerate(table) if row[i] > 0]
            return "\n".join(lines)
        extremes = torch.cat([-ms, ms])  # one MAX all-reduce gives both: min(x) = -max(-x)
        if world > 1:
            dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
        negated_low, high = extremes.view(2, -1).tolist()
        self.last_max_ms = {p: b for p, b in zip(PHASES, high) if b > 0}
        lines = ["max time across ranks (ms):" if self.option == "max" else "(min, max) time across ranks (ms):"]
        for phase, a, b in zip(PHASES, negated_low, high):
            if b > 0:
                value = f"{b:.2f}" if self.option == "max" else f"({-a:.2f}, {b:.2f})"
                lines.append(f"    {phase + ' ':.<48}: {value}")
        return "\n".join(lines)
