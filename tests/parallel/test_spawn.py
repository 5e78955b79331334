"""run_distributed (megalite/parallel/spawn.py): a rank that dies without reporting is named at
once, not after the whole timeout while the other ranks wait in a collective; a rank waiting in
a collective its peer never joins, on a group the function made itself, fails after the
collective timeout with gloo's error and its traceback."""

import os
import socket
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


def _rank_1_never_joins(rank, world_size):
    group = dist.new_group([0, 1])  # no timeout given: the default, which run_distributed sets
    if rank == 1:
        time.sleep(15)  # alive past rank 0's timeout, so its wait ends by that, not by a closed connection
        return torch.ones(1)
    dist.all_reduce(torch.ones(1), group=group)
    return torch.ones(1)


def test_a_rank_that_waits_for_good_fails_after_the_collective_timeout():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"(?s)_rank_1_never_joins failed on rank 0:.*all_reduce.*Timed out"):
        run_distributed(_rank_1_never_joins, 2, timeout=120, collective_timeout=2)
    assert time.monotonic() - started < 60


def test_a_rank_that_dies_silently_is_named_at_once():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match=r"_dies_on_rank_1: rank 1 exited with status 3 without a result"):
        run_distributed(_dies_on_rank_1, 2, timeout=120)
    assert time.monotonic() - started < 60


def test_results_come_back_in_rank_order():
    assert [t.item() for t in run_distributed(_rank_sum, 2)] == [1.0, 1.0]


def test_free_port_is_one_the_kernel_never_hands_out_and_skips_taken_ones():
    """A kernel-picked port could be taken by any connect() or gloo pair listener between the
    check and the rendezvous' bind (CI saw "The server socket has failed to listen")."""
    from megalite.parallel import spawn

    low = spawn._ephemeral_low()
    ports = [spawn.free_port() for _ in range(20)]
    assert len(set(ports)) == 20 and all(spawn._PORT_LOW <= p < max(low, spawn._PORT_LOW + 1000) for p in ports)
    with socket.socket() as held:
        held.bind(("127.0.0.1", ports[-1] + 1))
        assert spawn.free_port() != ports[-1] + 1
