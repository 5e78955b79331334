"""run_distributed (megalite/parallel/spawn.py): a rank that dies without reporting is named at
once, not after the whole timeout while the other ranks wait in a collective."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from megalite.parallel.spawn import run_distributed


def _dies_on_rank_1(rank, world_size):
    if rank == 1:
        os._exit(3)  # no traceback, no result: as a SIGKILL or a crash in C++ leaves it
    time.sleep(90)  # a wait that does not notice the peer is gone (a rendezvous, a store read)
    return torch.ones(1)


def _rank_sum(rank, world_size):
    t = torch.tensor([float(rank)])
    dist.all_reduce(t)
    return t


def test_a_rank_that_dies_silently_is_named_at_once():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"_dies_on_rank_1: rank 1 exited with status 3 without a result"):
        run_distributed(_dies_on_rank_1, 2, timeout=120)
    assert time.monotonic() - started < 60


def test_results_come_back_in_rank_order():
    assert [t.item() for t in run_distributed(_rank_sum, 2)] == [1.0, 1.0]
