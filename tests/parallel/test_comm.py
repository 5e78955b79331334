"""Every primitive of megalite.parallel.comm, forward and backward, against the result written
out from all ranks' tensors, at TP = 2 and 4 in one spawn of 4 gloo processes. The tensors hold
small integers, so sums are exact in any order and results are compared bit for bit.

Each rank r of a group of n feeds x_r and, in backward, the output gradient g_r; every rank
can build every other rank's x_j and g_j, so the expected results are local arithmetic."""

import zlib

import pytest
import torch

from megalite.parallel import comm
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.parallel.refusals import value_error_messages

S, B, H = 8, 3, 8  # [seq, batch, hidden]; S and H divisible by 4


def _ints(shape, *seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(repr(seed).encode()))
    return torch.randint(-9, 10, shape, generator=g).float()


def _chunk(t, n, dim, i):
    return t.chunk(n, dim)[i]


# name -> (primitive, input shape, output shape, expected output, expected input gradient);
# the expectations take (xs, gs, r, n): every rank's input and output gradient, this rank, size.
def _cases(n):
    full, seq_part, hid_part = (S, B, H), (S // n, B, H), (S, B, H // n)
    return {
        "copy_to_tensor_parallel_region (f)": (
            comm.copy_to_tensor_parallel_region, full, full,
            lambda xs, gs, r, n: xs[r], lambda xs, gs, r, n: sum(gs)),
        "reduce_from_tensor_parallel_region (g)": (
            comm.reduce_from_tensor_parallel_region, full, full,
            lambda xs, gs, r, n: sum(xs), lambda xs, gs, r, n: gs[r]),
        "scatter_to_tensor_parallel_region": (
            comm.scatter_to_tensor_parallel_region, full, hid_part,
            lambda xs, gs, r, n: _chunk(xs[r], n, -1, r), lambda xs, gs, r, n: torch.cat(gs, -1)),
        "gather_from_tensor_parallel_region": (
            comm.gather_from_tensor_parallel_region, hid_part, full,
            lambda xs, gs, r, n: torch.cat(xs, -1), lambda xs, gs, r, n: _chunk(gs[r], n, -1, r)),
        "scatter_to_sequence_parallel_region": (
            comm.scatter_to_sequence_parallel_region, full, seq_part,
            lambda xs, gs, r, n: _chunk(xs[r], n, 0, r), lambda xs, gs, r, n: torch.cat(gs, 0)),
        "gather_from_sequence_parallel_region(grad_is_partial=True)": (
            lambda x, group: comm.gather_from_sequence_parallel_region(x, group, grad_is_partial=True),
            seq_part, full,
            lambda xs, gs, r, n: torch.cat(xs, 0), lambda xs, gs, r, n: _chunk(sum(gs), n, 0, r)),
        "gather_from_sequence_parallel_region(grad_is_partial=False)": (
            lambda x, group: comm.gather_from_sequence_parallel_region(x, group, grad_is_partial=False),
            seq_part, full,
            lambda xs, gs, r, n: torch.cat(xs, 0), lambda xs, gs, r, n: _chunk(gs[r], n, 0, r)),
        "reduce_scatter_to_sequence_parallel_region": (
            comm.reduce_scatter_to_sequence_parallel_region, full, seq_part,
            lambda xs, gs, r, n: _chunk(sum(xs), n, 0, r), lambda xs, gs, r, n: torch.cat(gs, 0)),
        # plain (non-autograd) helpers: forward only
        "all_reduce": (lambda x, group: comm.all_reduce(x.clone(), group), full, full,
                       lambda xs, gs, r, n: sum(xs), None),
        "all_gather_dim0": (comm.all_gather_dim0, seq_part, full,
                            lambda xs, gs, r, n: torch.cat(xs, 0), None),
        "reduce_scatter_dim0": (comm.reduce_scatter_dim0, full, seq_part,
                                lambda xs, gs, r, n: _chunk(sum(xs), n, 0, r), None),
        "split_dim(dim=1 of [S, n*B, H])": (
            lambda x, group: comm.split_dim(x, 1, group), (S, n * B, H), full,
            lambda xs, gs, r, n: _chunk(xs[r], n, 1, r), None),
        "gather_dim(dim=1)": (lambda x, group: comm.gather_dim(x, 1, group), full, (S, n * B, H),
                              lambda xs, gs, r, n: torch.cat(xs, 1), None),
    }


def _check_group(state, tp):
    """For each primitive: (output ok, input gradient ok, input left unchanged) on this rank."""
    group, r, n = state.tp_group, state.tp_rank, tp
    results = {}
    for name, (fn, in_shape, out_shape, want_out, want_grad) in _cases(n).items():
        xs = [_ints(in_shape, name, "x", j) for j in range(n)]
        gs = [_ints(out_shape, name, "g", j) for j in range(n)]
        x = xs[r].clone().requires_grad_(want_grad is not None)
        y = fn(x, group)
        grad_ok = True
        if want_grad is not None and y.shape == x.shape:
            # x also feeds the sum directly: autograd hands that branch and the primitive's
            # backward the same gradient tensor, so a backward changing it in place shows here.
            (y + x).backward(gs[r])
            grad_ok = torch.equal(x.grad, want_grad(xs, gs, r, n) + gs[r])
        elif want_grad is not None:
            y.backward(gs[r])
            grad_ok = torch.equal(x.grad, want_grad(xs, gs, r, n))
        results[name] = (tuple(y.shape) == out_shape and torch.equal(y.detach(), want_out(xs, gs, r, n)),
                         grad_ok, torch.equal(x.detach(), xs[r]))
    return results


def _refusals(group):
    return value_error_messages(lambda: comm.reduce_scatter_dim0(torch.zeros(6, 2), group),
                                lambda: comm.split_dim(torch.zeros(2, 6), 1, group))


def _worker(rank, world_size):
    out = {}
    for tp in (2, 4):
        state = ParallelState.create(ParallelLayout(world_size, tensor=tp))
        out[tp] = {"results": _check_group(state, tp), "refusals": _refusals(state.tp_group)}
    return out


@pytest.fixture(scope="module")
def comm_results():
    return run_distributed(_worker, 4)


@pytest.mark.parametrize("tp", [2, 4])
def test_every_primitive_forward_and_backward(comm_results, tp):
    names = list(_cases(tp))
    assert len(names) == 13
    for rank, rank_results in enumerate(comm_results):
        results = rank_results[tp]["results"]
        assert list(results) == names
        for name, (out_ok, grad_ok, input_kept) in results.items():
            assert out_ok, f"TP={tp} rank {rank}: wrong forward result of {name}"
            assert grad_ok, f"TP={tp} rank {rank}: wrong input gradient of {name}"
            assert input_kept, f"TP={tp} rank {rank}: {name} changed its input"


def test_indivisible_sizes_are_named(comm_results):
    assert comm_results[0][4]["refusals"] == [
        "reduce-scatter: dim 0 of size 6 is not divisible by group size 4",
        "cannot split dim 1 of size 6 over 4 ranks",
    ]


def test_single_process_is_the_identity():
    """A group of None (one process) makes every primitive return its input untouched."""
    x = torch.randn(4, 2, 6)
    for name, (fn, *_rest) in _cases(1).items():
        assert fn(x, None) is x or torch.equal(fn(x, None), x), name
