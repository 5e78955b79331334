"""--overlap-param-gather-with-optimizer-step: the first model chunk's parameters are updated
first and their all-gather runs while the other chunks are updated. 4 gloo processes, PP = 2
with 2 virtual stages x DP = 2, the distributed optimizer with overlapped gradient reduction
and parameter gather, three steps of the interleaved schedule against the single-process run
of the same optimizer (fp32, 1e-5 relative) and against the run without the flag (bitwise:
Adam is per element, so the two phases give the one-phase update).

Megatron's behaviour: megatron/core/optimizer/__init__.py get_megatron_optimizer builds the
first model chunk's optimizer apart when overlap_param_gather_with_optimizer_step is set;
optimizer.py ChainedOptimizer._step dispatches model_chunks[0].start_param_sync(force_dispatch
=True) right after that optimizer steps, before the others; megatron/training/training.py
disables bucketing for it (one bucket per chunk); arguments.py validate_args requires the
distributed optimizer, --overlap-param-gather and interleaved pipeline parallelism.

Fails if the flag is ignored: with it, the inner optimizer steps twice per step, and while it
updates the other chunks the first chunk's all-gather is already in flight (its buckets hold a
pending work) while theirs is not; each chunk has one bucket (besides the tied embedding's).
"""

import contextlib

import pytest
import torch

from megalite.model.gpt import masked_mean_loss
from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step
from megalite.model.weights import gather_full_weights
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel.data.ddp import DistributedDataParallel, finalize_model_grads
from megalite.parallel.pipeline.executor import PipelineExecutor
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.numerics import rel_error
from tests.parallel.pipeline.pipeline_cases import HIDDEN, INIT_SEED, MICRO_BATCH, SEQ, make_config, microbatches

STEPS, M, TOL = 3, 4, 1e-5
OPTIM = dict(lr=1e-3, adam_eps=1e-3, weight_decay=0.1, clip_grad=1.0)


def _data(step, dp_rank):
    return microbatches(M, seed=10 * step + dp_rank)


def _pipelined(state, with_step: bool) -> dict:
    config = make_config("gpt2")
    models = build_model_chunks(config, state, init_seed=INIT_SEED)
    chunks = [DistributedDataParallel(m, state, overlap_grad_reduce=True, bucket_size=2000,
                                      use_distributed_optimizer=True, disable_bucketing=with_step) for m in models]
    optimizer = build_optimizer(chunks, state, use_distributed_optimizer=True, overlap_param_gather=True,
                                overlap_param_gather_with_optimizer_step=with_step, **OPTIM)
    executor = PipelineExecutor(chunks, state, "interleaved_1f1b", num_microbatches=M, seq_length=SEQ,
                                micro_batch_size=MICRO_BATCH, hidden_size=HIDDEN, sequence_parallel=False,
                                forward_step=gpt_forward_step)
    phases, real_step = [], optimizer.inner.step

    def recording_step(*args, **kwargs):  # which chunks' all-gathers are in flight as each phase updates
        phases.append([any(b.param_work is not None for b in c.buckets) for c in chunks])
        return real_step(*args, **kwargs)
    optimizer.inner.step = recording_step
    norms = []
    for step in range(STEPS):
        optimizer.zero_grad()
        executor.run(_data(step, state.dp_rank) if state.is_first_stage or state.is_last_stage else None)
        finalize_model_grads(chunks, state)
        norms.append(optimizer.step()[1])
    optimizer.finish_param_sync()
    params = {}
    for chunk in chunks:
        params.update(gather_full_weights(chunk.module))
    # buckets besides the tied embedding's own (the distributed optimizer lays it out alone)
    buckets = [len(c.buckets) - sum(getattr(p, "shared_embedding", False) for p in c.module.parameters())
               for c in chunks]
    return {"params": params, "norms": norms, "phases": phases, "buckets": buckets}


def _single_process() -> dict:
    state = ParallelState.single()
    (model,) = build_model_chunks(make_config("gpt2"), state, init_seed=INIT_SEED)
    chunk = DistributedDataParallel(model, state)
    optimizer = build_optimizer([chunk], state, **OPTIM)
    norms = []
    for step in range(STEPS):
        optimizer.zero_grad()
        batches = _data(step, 0) + _data(step, 1)
        for i, mb in enumerate(batches):
            with chunk.no_sync() if i < len(batches) - 1 else contextlib.nullcontext():
                loss = masked_mean_loss(chunk(mb["tokens"], labels=mb["labels"]), mb["loss_mask"])
                (loss / len(batches)).backward()
        finalize_model_grads([chunk], state)
        norms.append(optimizer.step()[1])
    return {"params": gather_full_weights(model), "norms": norms}


def _worker(rank, world_size):
    state = ParallelState.create(ParallelLayout(world_size, pipeline=2, virtual_pipeline=2))
    return {with_step: _pipelined(state, with_step) for with_step in (False, True)}


@pytest.fixture(scope="module")
def spawned():
    return run_distributed(_worker, 4)


def test_equals_the_single_process_run_and_the_run_without_it(spawned):
    reference = _single_process()
    covered = set()
    for rank, result in enumerate(spawned):
        ours, without = result[True], result[False]
        for name, value in ours["params"].items():
            assert torch.equal(value, without["params"][name]), f"rank {rank}: {name} differs from the one-phase update"
            assert rel_error(value, reference["params"][name]) <= TOL, f"rank {rank}: {name}"
            covered.add(name)
        for a, b in zip(ours["norms"], reference["norms"]):
            assert abs(a - b) <= TOL * b, (rank, ours["norms"], reference["norms"])
    assert covered == set(reference["params"])


def test_the_first_chunks_gather_runs_while_the_other_chunks_update(spawned):
    for rank, result in enumerate(spawned):
        assert result[False]["phases"] == [[False, False]] * STEPS, (rank, result[False]["phases"])
        assert result[True]["phases"] == [[False, False], [True, False]] * STEPS, (rank, result[True]["phases"])
        assert result[True]["buckets"] == [1, 1] and result[False]["buckets"] != [1, 1], (rank, result)
