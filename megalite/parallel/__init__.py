"""Parallelism, one folder per dimension, with what every dimension shares at the top.

    state.py      ParallelLayout (the sizes) and ParallelState (this rank's groups), passed
                  explicitly, never global
    comm.py       Megatron's f/g and the sequence-parallel primitives, as autograd Functions
    random.py     seeding and the per-TP-rank dropout RNG tracker
    sharding.py   marking parameters sharded and slicing a rank's shard of a full tensor
    spawn.py      running a function on N spawned gloo processes (tests, benchmarks)
    tensor/       tensor (and sequence) parallelism: parallel linears, embedding, cross-entropy
    pipeline/     pipeline parallelism: schedules, simulator, executor, p2p, stage layout
    data/         data parallelism: gradient buffers and their reduction, DDP, FSDP2

Context (sequence split over ranks) and expert parallelism get folders of their own beside
these (context/, expert/). Imports point down only: modules here import torch, megalite.kernels
and each other (a dimension may use the shared modules, never another dimension's internals
upward), and never megalite.model, megalite.training or megalite.optimizer.
"""
