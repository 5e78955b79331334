"""Megatron-FSDP's flags served by megalite's data parallelism: each
--data-parallel-sharding-strategy, from the command line through the typed config to the
wrapper the training run builds (setup_run.wrap_chunks), trains as the single-process run
(fp32, the data-parallel battery's tolerance) at DP = 4 in spawned gloo processes; and
--calculate-per-token-loss, which Megatron's functional test runs with optim_grads_params, with
FSDP2 against the single-process per-token run.

Megatron's behaviour: megatron/core/distributed/fsdp (Megatron-FSDP) shards per
data_parallel_sharding_strategy: no_shard (replicated, all-reduce), optim (optimizer state),
optim_grads (optimizer state and gradients), optim_grads_params (and parameters, ZeRO-3);
megatron_fsdp_grad_comm_dtype is the reduction's dtype (megatron/training/arguments.py
validate_args maps the dtype strings; training.py get_model passes them to the DDP config).

Fails if a flag is ignored: no_shard builds DDP without the distributed optimizer, optim DDP
with it, optim_grads FSDP2 keeping the parameters unsharded from forward to backward (ZeRO-2),
optim_grads_params FSDP2 resharding them after forward; --megatron-fsdp-grad-comm-dtype bf16
reduce-scatters bf16 gradients.
"""

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from megalite.config.arguments import parse_args, validate_args
from megalite.config.run_config import OptimizerConfig, ParallelConfig
from megalite.model.gpt import masked_mean_loss
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.data.fsdp import FSDPChunk
from megalite.parallel.expert.groups import ExpertState
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.training.setup_run import wrap_chunks
from tests.config.test_arguments import BASE
from tests.distributed import run_distributed
from tests.model.test_gpt_tp import make_config
from tests.numerics import rel_error
from tests.parallel.data.test_data_parallel import (OPTIM, TOL, full_params, make_model, micro_batches,
                                                    reference_run, train_step)
from tests.parallel.expert import ep_harness

STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
MICRO, STEPS = 2, 3


def _parallel(world_size, extra: str):
    args = validate_args(parse_args(BASE + f"--use-megatron-fsdp {extra}".split()), world_size)
    return ParallelConfig.from_args(args, world_size), OptimizerConfig.from_args(args)


def _sharded_after_forward(chunk, pstate) -> bool:
    tokens, labels, mask = micro_batches(0, pstate.dp_rank, pstate.dp_size, MICRO)[0]
    loss = masked_mean_loss(chunk(tokens, labels=labels), mask)
    sharded = isinstance(chunk.module.layers["0"].self_attention.linear_qkv.weight, DTensor)
    loss.backward()
    chunk.zero_grad_buffer()
    return sharded


def _strategy(pstate, world_size, strategy) -> dict:
    parallel, optim = _parallel(world_size, f"--data-parallel-sharding-strategy {strategy}")
    (chunk,) = wrap_chunks([make_model(make_config("gpt2"), pstate)], parallel, pstate)
    optimizer = build_optimizer([chunk], pstate, use_distributed_optimizer=optim.use_distributed_optimizer,
                                **OPTIM)
    built = {"fsdp2": isinstance(chunk, FSDPChunk),
             "distributed_optimizer": isinstance(chunk, DistributedDataParallel) and chunk.use_distributed_optimizer,
             "sharded_buckets": isinstance(chunk, DistributedDataParallel) and all(b.sharded_over_dp
                                                                                 for b in chunk.buckets),
             "sharded_after_forward": _sharded_after_forward(chunk, pstate) if isinstance(chunk, FSDPChunk) else None}
    norms = [train_step(chunk, optimizer, pstate, step, MICRO)[1] for step in range(STEPS)]
    return {"built": built, "params": full_params(chunk.module, None), "norms": norms}


def _reduce_dtypes(pstate, world_size) -> set:
    parallel, _ = _parallel(world_size, "--megatron-fsdp-grad-comm-dtype bf16")
    (chunk,) = wrap_chunks([make_model(make_config("gpt2"), pstate)], parallel, pstate)
    dtypes, real = set(), dist.reduce_scatter_single

    def recording(output, input, *args, **kwargs):
        dtypes.add(input.dtype)
        return real(output, input, *args, **kwargs)
    dist.reduce_scatter_single = recording
    try:
        tokens, labels, mask = micro_batches(0, pstate.dp_rank, pstate.dp_size, MICRO)[0]
        masked_mean_loss(chunk(tokens, labels=labels), mask).backward()
    finally:
        dist.reduce_scatter_single = real
    return dtypes


def _worker(rank, world_size):
    torch.manual_seed(0)
    pstate = ParallelState.create(ParallelLayout(world_size))
    out = {strategy: _strategy(pstate, world_size, strategy) for strategy in STRATEGIES}
    out["reduce_dtypes"] = _reduce_dtypes(pstate, world_size)
    moe = ParallelState.create(ParallelLayout(world_size))
    moe.expert = ExpertState.create(moe, 2, num_experts=8)
    out["per_token_fsdp2"] = ep_harness.train(moe, ep_harness.moe_model_config("alltoall", "softmax"), fsdp=True,
                                              per_token=True)
    return out


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_worker, 4)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_each_strategy_trains_as_the_single_process_run(spawned, reference_runs, strategy):
    reference = reference_runs.get(reference_run, "gpt2", MICRO, STEPS)
    result = spawned[0][strategy]
    for name, expected in reference["params"].items():
        assert rel_error(result["params"][name], expected) <= TOL, f"{strategy}: {name}"
    for ours, ref in zip(result["norms"], reference["norms"]):
        assert abs(ours - ref) <= TOL * ref, f"{strategy}: grad norm {ours} vs {ref}"


@pytest.mark.parametrize("strategy, expected", [
    ("no_shard", dict(fsdp2=False, distributed_optimizer=False, sharded_buckets=False, sharded_after_forward=None)),
    ("optim", dict(fsdp2=False, distributed_optimizer=True, sharded_buckets=True, sharded_after_forward=None)),
    ("optim_grads", dict(fsdp2=True, distributed_optimizer=False, sharded_buckets=False, sharded_after_forward=False)),
    ("optim_grads_params", dict(fsdp2=True, distributed_optimizer=False, sharded_buckets=False,
                                sharded_after_forward=True)),
])
def test_each_strategy_builds_what_it_names(spawned, strategy, expected):
    for rank, result in enumerate(spawned):
        assert result[strategy]["built"] == expected, (rank, strategy)


def test_grad_comm_dtype_is_fsdp2s_reduce_dtype(spawned):
    for rank, result in enumerate(spawned):
        assert result["reduce_dtypes"] == {torch.bfloat16}, (rank, result["reduce_dtypes"])


def test_per_token_loss_with_fsdp2_equals_the_single_process_run(spawned, reference_runs):
    config = ep_harness.moe_model_config("alltoall", "softmax")
    reference = reference_runs.get(ep_harness.reference, config, per_token=True)
    assert ep_harness.compare([r["per_token_fsdp2"] for r in spawned], reference) == []
