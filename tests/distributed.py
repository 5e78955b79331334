"""The tests' spawned gloo processes: see megalite.parallel.spawn."""

from megalite.parallel.spawn import free_port, run_distributed

__all__ = ["free_port", "run_distributed"]
