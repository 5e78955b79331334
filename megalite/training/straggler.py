"""--log-straggler: each rank's forward-backward time per iteration over the log window,
gathered every --log-interval, with the slowest and fastest rank named. Megatron measures GPU
kernel time with nvidia-resiliency-ext's straggler detector; megalite times the same phase
(the pipeline schedule's forwards and backwards) with the wall clock, on CPU as on GPU."""

import torch
import torch.distributed as dist


def report_stragglers(seconds_per_iteration: float, pstate, device) -> str:
    """The one-line report (a collective over all ranks; every rank gets the line)."""
    mine = torch.tensor([seconds_per_iteration * 1000], dtype=torch.float64, device=device)
    times = [torch.empty_like(mine) for _ in range(pstate.world_size)] if pstate.world_size > 1 else [mine]
    if pstate.world_size > 1:
        dist.all_gather(times, mine)
    ms = [t.item() for t in times]
    slow, fast = max(range(len(ms)), key=ms.__getitem__), min(range(len(ms)), key=ms.__getitem__)
    ratio = ms[slow] / ms[fast] if ms[fast] > 0 else float("inf")
    return (f"straggler report (forward-backward ms per iteration): slowest rank {slow} {ms[slow]:.1f} | "
            f"fastest rank {fast} {ms[fast]:.1f} | slowest/fastest {ratio:.2f} | "
            + " ".join(f"{r}:{t:.1f}" for r, t in enumerate(ms)))
