"""Pipeline parallelism. A schedule is data: actions.py defines the actions (F, B, W and the
transfers), schedules.py generates each rank's list for GPipe, 1F1B, interleaved 1F1B and
ZB-H1, simulator.py runs all ranks' lists in pure Python (deadlocks, bubble), executor.py runs
one rank's list on its model chunks with p2p.py's batched transfers and split_backward.py's
deferred weight gradients, and stage_layout.py says which layers each (virtual) stage holds.

Imports megalite.parallel's shared modules only; the GPT model chunks and their forward step
live in megalite.model.pipeline_chunks.
"""
