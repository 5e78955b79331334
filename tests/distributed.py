"""The tests' spawned gloo processes: see megalite.parallel.spawn."""

import functools

from megalite.parallel import spawn
from megalite.parallel.spawn import free_port
from tests.rank_start import PRELOAD


@functools.wraps(spawn.run_distributed)
def run_distributed(fn, world_size: int, *args, **kwargs):
    return spawn.run_distributed(fn, world_size, *args, preload=PRELOAD, **kwargs)


__all__ = ["free_port", "run_distributed"]
