"""The distributed optimizer and FSDP2 sharded over DP x CP, against the single-process
reference.

One spawn of 4 gloo processes: five Adam steps (fp32, dropout off, the global batch of
test_data_parallel.py, each sequence split over the two CP ranks) give the single-process
losses and gradient norms within 1e-5 relative and the same parameters within 1e-5 (rel_error
per tensor) at CP = 2 x DP = 2 with the distributed optimizer (overlapped reduce-scatter and
parameter all-gather; and without overlap), without it, and with FSDP2 (its mesh DP x CP); and
at CP = 2 x TP = 2 (sequence parallelism) with FSDP2 (its mesh the CP group). Each rank of the DP x CP group owns
the contiguous 1/4 of every bucket (dp_checks.shard_layout_problems with d = DP x CP), and the
per-rank memory of bf16 with the distributed optimizer is formulas.md's 6 + 12/d with d = 4,
that of FSDP2 (fp32) 16/d.
"""

import contextlib

import pytest
import torch
import torch.distributed as dist

from megalite.optimizer.memory_report import memory_report
from megalite.parallel.context import split_sequence
from megalite.parallel.context.loss import cp_masked_mean
from megalite.parallel.data.ddp import finalize_model_grads
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.numerics import rel_error
from tests.parallel.data.dp_checks import overlapped_gather_problems, shard_layout_problems
from tests.parallel.data.test_data_parallel import GLOBAL_BATCH, build, full_params, micro_batches, reference_run

TOL = 1e-5
STEPS = 5
# (name, layout, family, accumulation steps, build options)
CONFIGS = [
    ("cp2dp2/distopt-overlap-gather/gpt2/acc2", "cp2dp2", "gpt2", 2,
     dict(dist_opt=True, overlap=True, bucket_size=8000, overlap_param_gather=True)),
    ("cp2dp2/distopt/llama/acc1", "cp2dp2", "llama", 1, dict(dist_opt=True)),
    ("cp2dp2/ddp/gpt2/acc1", "cp2dp2", "gpt2", 1, dict()),
    ("cp2dp2/fsdp2/gpt2/acc2", "cp2dp2", "gpt2", 2, dict(fsdp=True)),
    ("cp2dp2/fsdp2/llama/acc1", "cp2dp2", "llama", 1, dict(fsdp=True)),
    ("cp2tp2/fsdp2/llama/sp/acc2", "cp2tp2", "llama", 2, dict(fsdp=True, sp=True)),
]


def micro_size(pstate, accum: int) -> int:
    return GLOBAL_BATCH // (pstate.dp_size * accum)


def cp_train_step(chunk, optimizer, pstate, step: int, micro: int):
    """One optimizer step over this rank's micro-batches, each sequence split over the CP
    group: (the step's loss averaged over DP, optimizer.step()'s result)."""
    optimizer.zero_grad()
    batches = micro_batches(step, pstate.dp_rank, pstate.dp_size, micro)
    total = torch.zeros(())
    for i, batch in enumerate(batches):
        tokens, labels, mask = (split_sequence(t, 1, pstate.cp_size, pstate.cp_rank) for t in batch)
        with contextlib.nullcontext() if i == len(batches) - 1 else chunk.no_sync():
            loss = cp_masked_mean(chunk(tokens, labels=labels), mask, pstate.cp_group) / len(batches)
            optimizer.scale_loss(loss).backward()
        total += loss.detach()
    finalize_model_grads([chunk], pstate)
    if pstate.dp_size > 1:
        dist.all_reduce(total, group=pstate.dp_group)
    return total.item() / pstate.dp_size, optimizer.step()


def _train(pstate, family, accum, opts):
    chunk, optimizer = build(pstate, family, **opts)
    losses, norms = [], []
    for step in range(STEPS):
        loss, (ok, norm, _) = cp_train_step(chunk, optimizer, pstate, step, micro_size(pstate, accum))
        assert ok
        losses.append(loss)
        norms.append(norm)
    problems = shard_layout_problems(chunk, optimizer, pstate) if opts.get("dist_opt") else []
    if opts.get("overlap_param_gather"):
        batch = micro_batches(STEPS, pstate.dp_rank, pstate.dp_size, micro_size(pstate, accum))[0]
        problems += overlapped_gather_problems(
            chunk, pstate, *(split_sequence(t, 1, pstate.cp_size, pstate.cp_rank) for t in batch))
    optimizer.finish_param_sync()
    return {"losses": losses, "norms": norms, "params": full_params(chunk.module, pstate.tp_group),
            "problems": problems}


def _memory(pstate, fsdp=False):
    chunk, optimizer = build(pstate, "gpt2", dist_opt=not fsdp, fsdp=fsdp, params_dtype="float32" if fsdp else "bfloat16")
    cp_train_step(chunk, optimizer, pstate, 0, micro_size(pstate, 2))
    return memory_report([chunk], optimizer, pstate)[0]


def _worker(rank, world_size):
    torch.manual_seed(0)
    states = {"cp2dp2": ParallelState.create(ParallelLayout(world_size, context=2)),
              "cp2tp2": ParallelState.create(ParallelLayout(world_size, tensor=2, context=2))}
    out = {name: _train(states[layout], family, accum, opts) for name, layout, family, accum, opts in CONFIGS}
    out["memory"] = _memory(states["cp2dp2"])
    out["memory_fsdp"] = _memory(states["cp2dp2"], fsdp=True)
    return out


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_worker, 4)


@pytest.mark.parametrize("name, layout, family, accum, opts", CONFIGS, ids=[c[0] for c in CONFIGS])
def test_cp2_training_matches_single_process(spawned, reference_runs, name, layout, family, accum, opts):
    dp = 2 if layout == "cp2dp2" else 1
    reference = reference_runs.get(reference_run, family, GLOBAL_BATCH // (dp * accum), steps=STEPS)
    for rank, result in enumerate(spawned):
        ours = result[name]
        assert not ours["problems"], f"rank {rank}: " + "; ".join(ours["problems"][:5])
        for what in ("losses", "norms"):
            for step, (got, expected) in enumerate(zip(ours[what], reference[what])):
                assert abs(got - expected) <= TOL * abs(expected), f"rank {rank} {what} step {step}: {got} vs {expected}"
        for pname, expected in reference["params"].items():
            err = rel_error(ours["params"][pname], expected)
            assert err <= TOL, f"rank {rank}: {pname} relative error {err:.2e}"


def test_distributed_optimizer_memory_per_rank_is_the_formula_with_d_dp_times_cp(spawned):
    d = 4  # DP 2 x CP 2
    for rank, result in enumerate(spawned):
        info = result["memory"]
        assert info["formula_bytes_per_param"] == 6 + 12 / d and f"d={d}" in info["formula"], info
        assert abs(info["optimizer_bytes_per_param"] / (12 / d) - 1) < 0.01, (rank, info)
        assert abs(info["bytes_per_param"] / (6 + 12 / d) - 1) < 0.01, (rank, info)


def test_fsdp2_memory_per_rank_is_the_formula_with_d_dp_times_cp(spawned):
    d = 4  # DP 2 x CP 2: fp32 parameters, gradients and Adam state, all sharded
    for rank, result in enumerate(spawned):
        info = result["memory_fsdp"]
        assert info["formula_bytes_per_param"] == 16 / d and f"d={d}" in info["formula"], info
        assert abs(info["bytes_per_param"] / (16 / d) - 1) < 0.01, (rank, info)
