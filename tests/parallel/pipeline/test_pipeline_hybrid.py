"""The pipeline executor combined with tensor and data parallelism, as the training loop runs
it: 8 gloo processes, TP=2 x DP=2 x PP=2, each chunk wrapped in DistributedDataParallel
(overlapping gradient reduction), finalize_model_grads after every step, AdamW on the chunks'
parameters. Against the single-device run on the same global batch: the first step's
gradients, and the loss of three steps, within 1e-5 relative. The tied word embedding and its
copy on the last stage stay bit-identical through the steps, and each chunk's data-parallel
reduction starts during the step's last backward, not in finalize_model_grads."""

import pytest
import torch

from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step
from megalite.model.weights import gather_full_weights
from megalite.parallel.data.ddp import DistributedDataParallel, finalize_model_grads
from megalite.parallel.pipeline.executor import PipelineExecutor
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.numerics import assert_rel_close
from tests.parallel.pipeline.pipeline_cases import (HIDDEN, INIT_SEED, MICRO_BATCH, SEQ, TOL, VOCAB,
                                                    compare_grads, make_config, microbatches,
                                                    reference_run)

STEPS, LR = 3, 1e-2
# (family, sequence parallel, chunks per rank, schedule, micro-batches, first-stage layers)
CASES = [
    ("gpt2", True, 1, "1f1b", 4, None),
    ("gpt2", True, 2, "interleaved_1f1b", 4, None),
    ("gpt2", True, 1, "zb_h1", 3, None),
    ("llama", False, 1, "gpipe", 2, 2),
]


def case_id(case):
    family, sp, v, schedule, m, first = case
    return f"{family}-sp{int(sp)}-v{v}-{schedule}-m{m}" + (f"-first{first}" if first else "")


def _data(step, dp_rank, m):
    return microbatches(m, seed=100 * step + dp_rank)


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.01)


def _run_case(case, state):
    family, sp, v, schedule, m, first = case
    config = make_config(family, sequence_parallel=sp)
    chunks = [DistributedDataParallel(chunk, state, overlap_grad_reduce=True, bucket_size=5000)
              for chunk in build_model_chunks(config, state, num_layers_first=first,
                                              init_seed=INIT_SEED)]
    params = [p for chunk in chunks for p in chunk.module.parameters()]
    optimizer = _adamw(params)
    executor = PipelineExecutor(chunks, state, schedule, num_microbatches=m, seq_length=SEQ,
                                micro_batch_size=MICRO_BATCH, hidden_size=HIDDEN,
                                sequence_parallel=sp, forward_step=gpt_forward_step)
    result = {"losses": [], "started_in_backward": True}
    has_data = state.is_first_stage or state.is_last_stage
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        loss = executor.run(_data(step, state.dp_rank, m) if has_data else None)
        result["started_in_backward"] &= all(b.grad_started for c in chunks for b in c.buckets)
        finalize_model_grads(chunks, state)
        result["losses"].append(loss)
        for p in params:
            p.grad = p.main_grad
        if step == 0:
            result["grads"] = {}
            for chunk in chunks:
                result["grads"].update(gather_full_weights(chunk.module, grads=True))
        optimizer.step()
    tied = [p for chunk in chunks for p in chunk.module.parameters()
            if getattr(p, "shared_embedding", False)]
    result["tied"] = tied[0].detach().clone() if tied else None
    return result


def _hybrid_worker(rank, world_size, cases):
    states = {v: ParallelState.create(ParallelLayout(world_size, tensor=2, pipeline=2,
                                                     virtual_pipeline=v))
              for v in sorted({c[2] for c in cases})}
    out = {}
    for case in cases:
        state = states[case[2]]
        out[(case_id(case), state.tp_rank, state.dp_rank, state.pp_rank)] = _run_case(case, state)
    return out


@pytest.fixture(scope="module")
def hybrid_results():
    merged = {}
    for rank_result in run_distributed(_hybrid_worker, 8, CASES):
        merged.update(rank_result)
    return merged


def _reference_steps(config, m):
    """Single device, global batch of both data-parallel replicas, AdamW: step-0 gradients and
    the loss of every step."""
    from megalite.model.gpt import GPTModel, masked_mean_loss
    from megalite.parallel.state import ParallelState as State
    model = GPTModel(config, State.single(), init_seed=INIT_SEED)
    first = reference_run(config, [_data(0, dp, m) for dp in range(2)])
    optimizer = _adamw(model.parameters())
    losses = []
    for step in range(STEPS):
        optimizer.zero_grad()
        batch = [mb for dp in range(2) for mb in _data(step, dp, m)]
        total = 0.0
        for mb in batch:
            loss = masked_mean_loss(model(mb["tokens"], labels=mb["labels"]), mb["loss_mask"])
            (loss / len(batch)).backward()
            total += loss.detach() / len(batch)
        losses.append(total)
        optimizer.step()
    return first, losses


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_tp_dp_pp_matches_single_device(hybrid_results, case):
    family, sp, v, schedule, m, first = case
    what = f"TP2xDP2xPP2 {case_id(case)}"
    reference, reference_losses = _reference_steps(make_config(family), m)
    results = {key[1:]: value for key, value in hybrid_results.items() if key[0] == case_id(case)}
    assert len(results) == 8
    compare_grads([results[(0, dp, pp)]["grads"] for dp in (0, 1) for pp in (0, 1)],
                  reference, what)
    for step in range(STEPS):
        for tp in (0, 1):
            assert all(results[(tp, dp, 0)]["losses"][step] is None for dp in (0, 1))
            loss = sum(results[(tp, dp, 1)]["losses"][step] for dp in (0, 1)) / 2
            assert_rel_close(loss, reference_losses[step], TOL, f"{what} loss of step {step}")
    assert all(r["started_in_backward"] for r in results.values()), \
        f"{what}: a data-parallel reduction did not start in the last backward"
    if family == "gpt2":  # tied embeddings: first-stage table == last-stage output weight
        for tp in (0, 1):
            for dp in (0, 1):
                first_copy, last_copy = results[(tp, dp, 0)]["tied"], results[(tp, dp, 1)]["tied"]
                assert torch.equal(first_copy, last_copy), \
                    f"{what}: tied copies differ (tp {tp}, dp {dp})"
        start = reference["params"]["embedding.word_embeddings.weight"]
        assert not torch.allclose(results[(0, 0, 0)]["tied"][:VOCAB], start[:VOCAB]), \
            f"{what}: the embedding did not train"
