"""--num-distributed-optimizer-instances: the distributed optimizer sharded within each of N
instances (contiguous blocks of DP x CP / N ranks) and replicated across them, against the
single-process run (fp32, the data-parallel battery's tolerance), in 4 spawned gloo processes.

Megatron's behaviour: megatron/core/parallel_state.py initialize_model_parallel cuts each
DP x CP group into num_distributed_optimizer_instances contiguous intra-instance groups and
builds the inter-instance groups across them; distributed/param_and_grad_buffer.py
_ParamAndGradBucketGroup.start_grad_sync reduce-scatters each bucket within the instance and
all-reduces the shard across instances, start_param_sync all-gathers within the instance;
optimizer/__init__.py sums gradient statistics over the intra-instance group
(grad_stats_parallel_group); distrib_optimizer.py shards the state over the instance.

Checked here: training equals the single-process run (overlap on and off, gradient
accumulation, TP = 2 with one-rank instances, an MoE model with expert parallelism); each rank
owns 1/s of every bucket with s = DP x CP / N (not 1/(DP x CP), which an ignored flag gives)
and its replica in the other instance holds bitwise the same shard; memory per rank is
6 + 12/s bytes per parameter (bf16); a checkpoint saved with 2 instances resumes with 1 and 4,
and one saved with 1 resumes with 2, every optimizer element intact.
"""

import pytest
import torch
import torch.distributed as dist

from megalite.checkpoint.dcp.checkpoint import load_checkpoint, load_optimizer_state, save_checkpoint
from megalite.model.pipeline_chunks import build_model_chunks
from megalite.optimizer.memory_report import memory_report
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.expert.groups import ExpertState
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.model.test_gpt_tp import make_config
from tests.numerics import rel_error
from tests.parallel.data.test_data_parallel import (OPTIM, TOL, assert_replicas_identical, build, full_params,
                                                    reference_run, train_step)
from tests.parallel.expert import ep_harness

STEPS = 3
CASES = {  # name: (layout kwargs, family, micro-batch size, build options)
    "dp4/n2/acc1": (dict(optimizer_instances=2), "gpt2", 4, {}),
    "dp4/n2/ovl/acc2": (dict(optimizer_instances=2), "gpt2", 2, dict(overlap=True, bucket_size=8000)),
    "dp4/n4/acc1": (dict(optimizer_instances=4), "llama", 4, {}),
    "tp2dp2/n2/sp/acc2": (dict(tensor=2, optimizer_instances=2), "gpt2", 4, dict(sp=True, overlap=True,
                                                                                   bucket_size=8000)),
}


def _layout_problems(chunk, optimizer, pstate) -> list[str]:
    """Each bucket is sharded 1/s over its instance (s = DP x CP / N), and the rank holding the
    same shard in every other instance has bitwise the same main parameters and Adam state."""
    s, r = pstate.instance_dp_cp_size, pstate.instance_dp_cp_rank
    problems = []
    for bucket in chunk.buckets:
        if (bucket.dp_size, bucket.shard_size, bucket.shard_start) != (s, bucket.numel // s, r * bucket.numel // s):
            problems.append(f"rank {pstate.rank} bucket {bucket.index}: shard [{bucket.shard_start}, "
                            f"+{bucket.shard_size}) over {bucket.dp_size} ranks, expected 1/{s} of {bucket.numel}")
    values = [m.main.detach().reshape(-1) for m in optimizer.mains]
    values += [optimizer.inner.state[m.main][k].reshape(-1) for m in optimizer.mains for k in ("exp_avg", "exp_avg_sq")]
    mine = torch.cat(values)
    theirs = mine.clone()
    dist.broadcast(theirs, group_src=0, group=pstate.dp_cp_replica_group)
    if not torch.equal(mine, theirs):
        problems.append(f"rank {pstate.rank}: its shard differs from instance 0's copy")
    return problems


def _train_cases(world_size) -> dict:
    out = {}
    for name, (layout, family, micro, opts) in CASES.items():
        pstate = ParallelState.create(ParallelLayout(world_size, **layout))
        chunk, optimizer = build(pstate, family, dist_opt=True, **opts)
        norms = [train_step(chunk, optimizer, pstate, step, micro)[1] for step in range(STEPS)]
        problems = _layout_problems(chunk, optimizer, pstate)
        params = full_params(chunk.module, pstate.tp_group)
        assert_replicas_identical(params, pstate)
        out[name] = {"params": params, "norms": norms, "problems": problems,
                     "owned": sum(m.hi - m.lo for m in optimizer.mains)}
    return out


def _memory(world_size) -> dict:
    out = {}
    for n in (1, 2):
        pstate = ParallelState.create(ParallelLayout(world_size, optimizer_instances=n))
        chunk, optimizer = build(pstate, "gpt2", dist_opt=True, params_dtype="bfloat16")
        train_step(chunk, optimizer, pstate, 0, 4)
        out[n] = memory_report([chunk], optimizer, pstate)
    return out


def _moe(world_size) -> dict:
    """EP = 2 at DP = 4: dense instances of 2 ranks, expert instances of 1 (EDP = 2)."""
    pstate = ParallelState.create(ParallelLayout(world_size, optimizer_instances=2))
    pstate.expert = ExpertState.create(pstate, 2, num_experts=8)
    config = ep_harness.moe_model_config("alltoall", "softmax")
    return ep_harness.train(pstate, config, dist_opt=True)


# --- checkpoints: saved with one instance count, loaded with another -------------------------
def _chunks(pstate, instances_config):
    models = build_model_chunks(instances_config, pstate, init_seed=99)
    chunks = [DistributedDataParallel(m, pstate, bucket_size=3000, use_distributed_optimizer=True) for m in models]
    return models, chunks, build_optimizer(chunks, pstate, use_distributed_optimizer=True, **OPTIM)


def _gathered(optimizer) -> dict:
    state = optimizer.state_dict()
    return {"step": state["step"], **{(n, k): v for n, entry in state["params"].items() for k, v in entry.items()}}


def _resharding(world_size, root) -> dict:
    config = make_config("gpt2", activation="swiglu")
    out = {}
    for saved_n, loaded in ((2, (1, 4)), (1, (2,))):
        pstate = ParallelState.create(ParallelLayout(world_size, optimizer_instances=saved_n))
        models, chunks, optimizer = _chunks(pstate, config)
        for step in range(2):
            train_step(chunks[0], optimizer, pstate, step, 4)
        path = f"{root}/n{saved_n}"
        save_checkpoint(path, 2, chunks=models, optimizer=optimizer, pstate=pstate, common={})
        saved = _gathered(optimizer)
        for n in loaded:
            state = ParallelState.create(ParallelLayout(world_size, optimizer_instances=n))
            models, chunks, loaded_optimizer = _chunks(state, config)
            common = load_checkpoint(path, chunks=models, pstate=state)
            load_optimizer_state(common, chunks=models, optimizer=loaded_optimizer, pstate=state)
            got = _gathered(loaded_optimizer)
            out[f"n{saved_n}->n{n}"] = {"keys": set(got) == set(saved),
                                         "worst": max(rel_error(got[k], v) if torch.is_tensor(v) else float(got[k] != v)
                                                      for k, v in saved.items())}
    return out


def _worker(rank, world_size, root):
    torch.manual_seed(0)
    return {"train": _train_cases(world_size), "memory": _memory(world_size), "moe": _moe(world_size),
            "resharding": _resharding(world_size, root)}


@pytest.fixture(scope="module")
def spawned(tmp_path_factory):
    return run_distributed(_worker, 4, str(tmp_path_factory.mktemp("instances")))


@pytest.mark.parametrize("name", list(CASES))
def test_instances_train_as_the_single_process_run(spawned, reference_runs, name):
    _, family, micro, _ = CASES[name]
    reference = reference_runs.get(reference_run, family, micro, STEPS)
    result = spawned[0]["train"][name]
    for pname, expected in reference["params"].items():
        assert rel_error(result["params"][pname], expected) <= TOL, f"{name}: {pname}"
    for ours, ref in zip(result["norms"], reference["norms"]):  # each instance's gradients counted once
        assert abs(ours - ref) <= TOL * ref, f"{name}: grad norm {ours} vs {ref}"


@pytest.mark.parametrize("name", list(CASES))
def test_each_instance_shards_its_buckets_and_holds_the_other_instances_copy(spawned, name):
    for rank, result in enumerate(spawned):
        assert result["train"][name]["problems"] == [], f"rank {rank}"


def test_a_rank_owns_one_instances_share_of_the_optimizer_state(spawned):
    """Fails if the flag is ignored: with 2 instances at DP = 4 a rank owns twice the state of
    the 4-way shard, with 4 instances all of it."""
    owned = {name: sum(r["train"][name]["owned"] for r in spawned) for name in ("dp4/n2/acc1", "dp4/n4/acc1")}
    per_rank_n2 = [r["train"]["dp4/n2/acc1"]["owned"] for r in spawned]
    total_n2 = owned["dp4/n2/acc1"] / 2  # every element owned twice, once per instance
    assert all(abs(n - total_n2 / 2) <= total_n2 * 0.1 for n in per_rank_n2), per_rank_n2
    assert all(r["train"]["dp4/n4/acc1"]["owned"] == spawned[0]["train"]["dp4/n4/acc1"]["owned"] for r in spawned)


@pytest.mark.parametrize("n", [1, 2])
def test_memory_per_rank_is_6_plus_12_over_the_instance_size(spawned, n):
    info, line = spawned[0]["memory"][n]
    s = 4 // n
    assert info["formula_bytes_per_param"] == 6 + 12 / s, line
    assert abs(info["bytes_per_param"] / (6 + 12 / s) - 1) < 0.01, line
    assert abs(info["optimizer_bytes_per_param"] / (12 / s) - 1) < 0.01, line
    assert (f"one of {n} instances" in line) == (n > 1), line


def test_moe_with_instances_equals_the_single_process_run(spawned, reference_runs):
    config = ep_harness.moe_model_config("alltoall", "softmax")
    reference = reference_runs.get(ep_harness.reference, config)
    assert ep_harness.compare([r["moe"] for r in spawned], reference) == []


@pytest.mark.parametrize("case", ["n2->n1", "n2->n4", "n1->n2"])
def test_checkpoints_reshard_across_instance_counts(spawned, case):
    for rank, result in enumerate(spawned):
        loaded = result["resharding"][case]
        assert loaded["keys"] and loaded["worst"] == 0.0, (rank, case, loaded)
