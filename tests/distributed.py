"""The tests' spawned gloo processes: see megalite.parallel.spawn."""

import functools

from megalite.parallel import spawn
from megalite.parallel.spawn import free_port

# What the fork server imports once, for every rank of run_distributed and every program of
# tests/forked_program.py (tests/rank_start.py first: it sets up the server as conftest.py does
# the test process; importing it anywhere else would change that process)
PRELOAD = ("tests.rank_start", "megalite.model.gpt", "megalite.training.setup_run", "megalite.training.loop",
           "megalite.config.arguments", "megalite.optimizer.mixed_precision", "megalite.parallel.pipeline.executor")


@functools.wraps(spawn.run_distributed)
def run_distributed(fn, world_size: int, *args, **kwargs):
    return spawn.run_distributed(fn, world_size, *args, preload=PRELOAD, **kwargs)


__all__ = ["free_port", "run_distributed"]
