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


def _worker(rank, world_size):
    """{(tensor size, corrupted): the error or None}, for DP=2 and TP=2 in one spawn."""
    out = {}
    for tensor in (1, 2):
        state = ParallelState.create(ParallelLayout(world_size, tensor=tensor))
        for corrupt in (False, True):
            try:
                check_qk_layernorm_replicas(_models(rank, corrupt), state, 7)
                out[(tensor, corrupt)] = None
            except RuntimeError as error:
                out[(tensor, corrupt)] = str(error)
    return out


def test_only_q_and_k_layernorm_parameters_are_compared():
    names = [name for name, _ in qk_layernorm_parameters(_models(0, False))]
    assert names == [f"layers.{n}.self_attention.{w}_layernorm.{p}" for n in (2, 3) for w in "qk"
                     for p in ("weight", "bias")]


def test_a_differing_weight_stops_the_run_naming_it():
    results = run_distributed(_worker, 2)
    for tensor, kind in ((1, "data-parallel"), (2, "tensor-parallel")):
        assert [r[(tensor, False)] for r in results] == [None, None]
        assert [r[(tensor, True)] for r in results] == [
            f"--test-mode: at iteration 7 layers.3.self_attention.k_layernorm.bias differs between {kind} ranks "
            f"{1 - r} and {r} (norm of the difference 1.000e-03)" for r in (0, 1)]


def _train_step(rank, world_size, port, test_mode):
    """One training step of a DP=2 run whose rank 1 holds a corrupted k_layernorm weight."""
    import os

    import torch.distributed as dist

    from megalite.config.arguments import parse_args
    from megalite.training.loop import Trainer
    from megalite.training.setup_run import build_run, data_iterator
    from tests.training.launch import BASE, drop_flags

    dist.destroy_process_group()  # build_run joins its own
    os.environ["MASTER_PORT"] = str(port)
    run = build_run(parse_args(drop_flags(BASE, "--log-interval") + ["--train-iters", "4", "--qk-layernorm",
                                                                     "--eval-iters", "0"] + test_mode))
    trainer = Trainer(run)
    if rank == 1:
        with torch.no_grad():
            run.models[0].get_parameter("layers.1.self_attention.k_layernorm.weight")[0] += 0.5
    try:
        trainer.train_step(data_iterator(run, trainer.train_ds, 0))
    except RuntimeError as error:
        return str(error)
    finally:
        trainer.close()
    return None


def test_the_training_loop_runs_the_check():
    from megalite.parallel.spawn import free_port

    errors = run_distributed(_train_step, 2, free_port(), ["--test-mode"], timeout=300)
    assert errors[0].startswith("--test-mode: at iteration 1 layers.1.self_attention.k_layernorm.weight differs "
                                "between data-parallel ranks 1 and 0")


@pytest.mark.slow
def test_without_the_flag_nothing_is_compared():
    from megalite.parallel.spawn import free_port

    assert run_distributed(_train_step, 2, free_port(), [], timeout=300) == [None, None]
