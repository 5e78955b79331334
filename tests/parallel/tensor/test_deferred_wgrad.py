"""--defer-embedding-wgrad-compute / --wgrad-deferral-limit: the output layer's weight-gradient
GEMMs of the first `limit` micro-batches (all with 0) left out of their backward and computed
when DistributedDataParallel finishes the step's gradient sync. 4 gloo processes, TP = 2 x
PP = 2 through the pipeline executor with overlapped gradient reduction; the gradients of two
steps against the single-device run within 1e-5 relative (fp32).

Megatron's behaviour: megatron/core/tensor_parallel/layers.py
LinearWithGradAccumulationAndAsyncCommunication.backward keeps grad_output in
grad_output_buffer instead of forming the weight gradient while fewer than
wgrad_deferral_limit are kept (or always with 0), ColumnParallelLinear.forward keeps the input
in embedding_activation_buffer, and pipeline_parallel/schedules.py
finish_embedding_wgrad_compute calls core/utils.py drain_embedding_wgrad_compute before
finalize_model_grads; core/model_parallel_config.py refuses it without pipeline parallelism.

Fails if the flag is ignored: at the drain, the kept micro-batches number `limit` (all of them
with 0), the output weight's gradient holds only the other micro-batches' share (none with 0:
the last stage's tied embedding copy gets its gradient from the output layer alone), and its
bucket's reduction has not started.
"""

import pytest

from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step
from megalite.model.weights import gather_full_weights
from megalite.parallel.data.ddp import DistributedDataParallel, finalize_model_grads
from megalite.parallel.pipeline.executor import PipelineExecutor
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.parallel.tensor.deferred_wgrad import defer_wgrad
from tests.distributed import run_distributed
from tests.parallel.pipeline.pipeline_cases import (HIDDEN, INIT_SEED, MICRO_BATCH, SEQ, compare_grads, make_config,
                                                    microbatches, reference_run)

M, STEPS = 4, 2
# (family, sequence parallel, chunks per rank, schedule, limit)
CASES = [("gpt2", True, 1, "1f1b", 0), ("gpt2", True, 1, "1f1b", 2), ("llama", False, 2, "interleaved_1f1b", 1)]


def _case_id(case):
    family, sp, v, schedule, limit = case
    return f"{family}-sp{int(sp)}-{schedule}-limit{limit}"


def _run(case, state):
    family, sp, v, schedule, limit = case
    config = make_config(family, sequence_parallel=sp)
    models = build_model_chunks(config, state, init_seed=INIT_SEED)
    deferral = defer_wgrad(models[-1].output_layer, limit) if models[-1].post_process else None
    chunks = [DistributedDataParallel(m, state, overlap_grad_reduce=True, bucket_size=5000) for m in models]
    executor = PipelineExecutor(chunks, state, schedule, num_microbatches=M, seq_length=SEQ,
                                micro_batch_size=MICRO_BATCH, hidden_size=HIDDEN, sequence_parallel=sp,
                                forward_step=gpt_forward_step)
    seen = []
    if deferral is not None:
        real_drain = deferral.drain
        weight_holder = chunks[-1]

        def drain():
            weight = deferral.pending[0][1]
            bucket = weight_holder._bucket_of[weight]
            seen.append({"kept": len(deferral.pending), "grad_norm": weight.main_grad.norm().item(),
                         "started": bucket.grad_started})
            real_drain()
        deferral.drain = drain
    result = {"grads": [], "seen": seen}
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        executor.run(microbatches(M, seed=step) if state.is_first_stage or state.is_last_stage else None)
        finalize_model_grads(chunks, state)
        grads = {}
        for chunk in chunks:
            for p in chunk.module.parameters():
                p.grad = p.main_grad
            grads.update(gather_full_weights(chunk.module, grads=True))
        result["grads"].append(grads)
    return result


def _worker(rank, world_size):
    state = {v: ParallelState.create(ParallelLayout(world_size, tensor=2, pipeline=2, virtual_pipeline=v))
             for v in (1, 2)}
    return {_case_id(case): _run(case, state[case[2]]) for case in CASES}


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_worker, 4)


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_deferred_wgrad_equals_the_single_device_gradients(spawned, case):
    config = make_config(case[0])
    for step in range(STEPS):
        reference = reference_run(config, [microbatches(M, seed=step)])
        compare_grads([r[_case_id(case)]["grads"][step] for r in spawned], reference, f"{_case_id(case)} step {step}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_the_kept_micro_batches_are_formed_at_the_drain(spawned, case):
    limit = case[4]
    last_stage = [r[_case_id(case)]["seen"] for r in spawned[2:]]  # ranks 2, 3: the last stage's TP ranks
    assert all(len(seen) == STEPS for seen in last_stage), last_stage
    assert not any(r[_case_id(case)]["seen"] for r in spawned[:2])
    for seen in last_stage:
        for at_drain in seen:
            assert at_drain["kept"] == (limit or M) and not at_drain["started"], at_drain
    for step in range(STEPS):  # over both TP shards of the weight (one may hold only vocabulary padding)
        norm = sum(seen[step]["grad_norm"] for seen in last_stage)
        assert (norm == 0.0) == (limit == 0), (step, last_stage)
