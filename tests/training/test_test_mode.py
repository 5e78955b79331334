"""--test-mode: Megatron's real-time test (megatron/core/transformer/attention.py,
Attention.run_realtime_tests) compares the q/k layernorm weights across data- and
tensor-parallel ranks and stops on a difference naming the parallelism and ranks. Two gloo
processes as DP=2 and as TP=2; equal weights pass, one flipped element stops with the layer,
the parameter and the ranks named."""

import pytest
import torch
from torch import nn

from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.training.test_mode import check_qk_layernorm_replicas, qk_layernorm_parameters
from tests.distributed import run_distributed


class _Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q_layernorm, self.k_layernorm = nn.LayerNorm(4), nn.LayerNorm(4)
        self.linear_proj = nn.Linear(4, 4)  # not compared: it is sharded (or legitimately differs)


def _models(rank, corrupt):
    model = nn.Module()
    model.layers = nn.ModuleDict({str(n): nn.Module() for n in (2, 3)})
    for layer in model.layers.values():
        layer.self_attention = _Attention()
        torch.nn.init.constant_(layer.self_attention.linear_proj.weight, float(rank))
    if corrupt and rank == 1:
        with torch.no_grad():
            model.layers["3"].self_attention.k_layernorm.bias[2] += 1e-3
    return [model]


def _worker(rank, world_size, tensor, corrupt):
    state = ParallelState.create(ParallelLayout(world_size, tensor=tensor))
    try:
        check_qk_layernorm_replicas(_models(rank, corrupt), state, 7)
    except RuntimeError as error:
        return str(error)
    return None


def test_only_q_and_k_layernorm_parameters_are_compared():
    names = [name for name, _ in qk_layernorm_parameters(_models(0, False))]
    assert names == [f"layers.{n}.self_attention.{w}_layernorm.{p}" for n in (2, 3) for w in "qk"
                     for p in ("weight", "bias")]


@pytest.mark.parametrize("tensor, kind", [(1, "data-parallel"), (2, "tensor-parallel")])
def test_a_differing_weight_stops_the_run_naming_it(tensor, kind):
    assert run_distributed(_worker, 2, tensor, False) == [None, None]
    errors = run_distributed(_worker, 2, tensor, True)
    assert errors == [f"--test-mode: at iteration 7 layers.3.self_attention.k_layernorm.bias differs between {kind} "
                      f"ranks {1 - r} and {r} (norm of the difference 1.000e-03)" for r in (0, 1)]
