"""The tests' spawned gloo processes: see megalite.parallel.spawn."""

import functools

from megalite.parallel import spawn
from megalite.parallel.spawn import free_port

# Imported once by the fork server the ranks start from (each rank would import them again)
PRELOAD = ("tests.rank_start", "megalite.model.gpt", "megalite.training.setup_run", "megalite.optimizer.mixed_precision",
           "megalite.parallel.pipeline.executor")


@functools.wraps(spawn.run_distributed)
def run_distributed(fn, world_size: int, *args, **kwargs):
    return spawn.run_distributed(fn, world_size, *args, preload=PRELOAD, **kwargs)


__all__ = ["free_port", "run_distributed"]
