"""The pipeline executor against the single-device run: at PP=2 and PP=4, one and two chunks
per rank, every schedule (interleaved also with micro-batch groups larger than p), even and
uneven stages, GPT-2 (tied embeddings) and Llama families,
the loss and every parameter's gradient equal the PP=1 control within 1e-5 relative (fp32,
dropout off). Also: output activations are freed once sent, p=1 is plain gradient
accumulation, and impossible configurations fail before any communication.

One spawn of 4 gloo processes runs every pipelined case: PP=4 cases on the whole world (both
families in turn), PP=2 cases on two pipelines at once (data-parallel replica 0 runs GPT-2,
replica 1 Llama; no data-parallel reduction is involved here)."""

from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step
from megalite.model.weights import gather_full_weights
from megalite.parallel.pipeline.actions import B, F, RECV_B, RECV_F, SEND_B, SEND_F, Action, peer
from megalite.parallel.pipeline.executor import (PipelineExecutor, deallocate_output,
                                                 eager_order, run_pipeline_step, unwrap)
from megalite.parallel.pipeline.schedules import all_ranks
from megalite.parallel.pipeline.simulator import simulate
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.numerics import assert_rel_close
from tests.parallel.pipeline.pipeline_cases import (FAMILIES, HIDDEN, INIT_SEED, MICRO_BATCH, NUM_LAYERS,
                                                    SEQ, TOL, all_reduce_shared_embedding_grads,
                                                    compare_grads, make_config, microbatches,
                                                    reference_run)

# (pipeline size, chunks per rank, schedule, micro-batches, first-stage layers, last-stage layers,
#  eager sends: None = the executor's choice, on for gloo; False = the schedule's batches as
#  listed, what runs on NCCL)
CASES = [
    *[(2, 1, s, m, None, None, None) for s in ("gpipe", "1f1b", "zb_h1") for m in (1, 3, 4)],
    (2, 2, "interleaved_1f1b", 2, None, None, None), (2, 2, "interleaved_1f1b", 6, None, None, None),
    (2, 1, "1f1b", 3, 3, None, None), (2, 1, "zb_h1", 4, None, 2, None),
    (2, 2, "interleaved_1f1b", 4, 2, None, None),
    *[(4, 1, s, m, None, None, None) for s in ("gpipe", "1f1b", "zb_h1") for m in (3, 8)],
    (4, 2, "interleaved_1f1b", 4, None, None, None), (4, 2, "interleaved_1f1b", 8, None, None, None),
    (4, 1, "gpipe", 4, 1, 1, None), (4, 1, "zb_h1", 5, 3, 1, None),
    (4, 2, "interleaved_1f1b", 4, 2, 2, None),
    *[(4, v, s, 8, None, None, False) for s, v in (("gpipe", 1), ("1f1b", 1), ("zb_h1", 1),
                                                   ("interleaved_1f1b", 2))],
    (2, 2, "interleaved_1f1b", 4, None, None, False),
    # --microbatch-group-size-per-virtual-pipeline-stage N > p (8th field): Megatron's documented
    # PP=2 VP=2 N=3 M=5 example, a last group smaller than N, and N = m
    (2, 2, "interleaved_1f1b", 5, None, None, None, 3), (2, 2, "interleaved_1f1b", 5, None, None, False, 3),
    (2, 2, "interleaved_1f1b", 6, None, None, None, 4), (4, 2, "interleaved_1f1b", 8, None, None, None, 8),
]


def case_id(case):
    p, v, schedule, m, first, last, eager, *group = case
    uneven = f"-first{first}" * (first is not None) + f"-last{last}" * (last is not None)
    grouped = f"-group{group[0]}" if group else ""
    return f"pp{p}-v{v}-{schedule}-m{m}{uneven}{grouped}" + ("-listed" if eager is False else "")


def _run_case(family, case, state):
    p, v, schedule, m, first, last, eager, *group = case
    group = group[0] if group else None
    config = make_config(family)
    chunks = build_model_chunks(config, state, num_layers_first=first, num_layers_last=last,
                                init_seed=INIT_SEED)
    sent_outputs = []

    def forward_step(chunk, batch, hidden_states):
        out = gpt_forward_step(chunk, batch, hidden_states)
        if not unwrap(chunk).post_process:
            sent_outputs.append(out)
        return out

    data = microbatches(m) if state.is_first_stage or state.is_last_stage else None
    executor = PipelineExecutor(chunks, state, schedule, num_microbatches=m, seq_length=SEQ,
                                micro_batch_size=MICRO_BATCH, hidden_size=HIDDEN,
                                forward_step=forward_step, eager_sends=eager, microbatch_group_size=group)
    with _watching_transfers() as posted:
        loss = executor.run(data)
    transfers = {"train": (posted, _transfer_kinds(executor.groups))}
    with torch.no_grad():  # evaluation: forwards only, same micro-batches, same loss
        data = microbatches(m) if state.is_first_stage or state.is_last_stage else None
        executor = PipelineExecutor(chunks, state, schedule, num_microbatches=m, seq_length=SEQ,
                                    micro_batch_size=MICRO_BATCH, hidden_size=HIDDEN, eager_sends=eager,
                                    forward_step=gpt_forward_step, microbatch_group_size=group)
        with _watching_transfers() as posted:
            eval_loss = executor.run(data, forward_only=True)
        transfers["eval"] = (posted, _transfer_kinds(executor.forward_groups))
    all_reduce_shared_embedding_grads(chunks, state)
    grads = {}
    for chunk in chunks:
        grads.update(gather_full_weights(chunk, grads=True))
    layers = sorted(int(n) for chunk in chunks for n in chunk.layers)
    kept = sum(t.untyped_storage().nbytes() > t.element_size() for t in sent_outputs)
    return {"loss": loss, "eval_loss": eval_loss, "grads": grads, "layers": layers,
            "outputs_kept": kept,
            "outputs_sent": len(sent_outputs), "transfers": transfers}


def _transfer_kinds(groups):
    """The executor's transfer batches, each as its list of isend/irecv."""
    return [["isend" if a.is_send else "irecv" for a in group] for group in groups if group[0].is_comm]


@contextmanager
def _watching_transfers():
    """Record every batch_isend_irecv call (as its list of isend/irecv) and fail on any device
    synchronise."""
    posted, batch_isend_irecv = [], dist.batch_isend_irecv

    def recording(ops):
        posted.append([op.op.__name__ for op in ops])
        return batch_isend_irecv(ops)

    def synchronize(*args, **kwargs):
        raise AssertionError("the pipeline executor synchronised the device")

    with mock.patch.object(dist, "batch_isend_irecv", recording), \
            mock.patch.object(torch.cuda, "synchronize", synchronize), \
            mock.patch.object(torch.cpu, "synchronize", synchronize):
        yield posted


def _pipeline_worker(rank, world_size, cases):
    states = {(p, v): ParallelState.create(ParallelLayout(world_size, pipeline=p, virtual_pipeline=v))
              for p, v in sorted({(c[0], c[1]) for c in cases})}
    out = {}
    for case in cases:
        state = states[(case[0], case[1])]
        families = FAMILIES if state.dp_size == 1 else [FAMILIES[state.dp_rank]]
        for family in families:
            out[(family, case_id(case), state.pp_rank)] = _run_case(family, case, state)
    return out


@pytest.fixture(scope="module")
def pipeline_results():
    merged = {}
    for rank_result in run_distributed(_pipeline_worker, 4, CASES):
        merged.update(rank_result)
    return merged


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(family, m):
        if (family, m) not in cache:
            cache[(family, m)] = reference_run(make_config(family), [microbatches(m)])
        return cache[(family, m)]
    return get


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_pipeline_matches_single_device(pipeline_results, references, family, case):
    p, v, schedule, m, first, last, *_ = case
    what = f"{family} {case_id(case)}"
    ranks = [pipeline_results[(family, case_id(case), r)] for r in range(p)]
    reference = references(family, m)
    assert all(r["loss"] is None for r in ranks[:-1]), f"{what}: loss reported off the last stage"
    assert_rel_close(ranks[-1]["loss"], reference["loss"], TOL, f"{what} loss")
    assert all(r["eval_loss"] is None for r in ranks[:-1]), what
    assert_rel_close(ranks[-1]["eval_loss"], reference["loss"], TOL, f"{what} forward-only loss")
    compare_grads([r["grads"] for r in ranks], reference, what)
    layers = [r["layers"] for r in ranks]
    assert sorted(sum(layers, [])) == list(range(NUM_LAYERS)), what
    if first is not None:
        assert len(layers[0]) == first, what
    if last is not None:
        assert len(layers[-1]) == last, what
    # One batch_isend_irecv per run of consecutive transfers in the executor's order, holding
    # exactly that run's sends and receives.
    for r, result in enumerate(ranks):
        for mode, (posted, batches) in result["transfers"].items():
            assert posted and posted == batches, f"{what}: rank {r} {mode} transfers"
    # Every output activation that was sent had its storage freed (Megatron's deallocation).
    assert sum(r["outputs_sent"] for r in ranks) == m * (p * v - 1), what
    assert all(r["outputs_kept"] == 0 for r in ranks), f"{what}: sent activations kept"


@pytest.mark.parametrize("family", FAMILIES)
def test_no_pipelining_is_gradient_accumulation(references, family):
    state = ParallelState.single()
    reference = references(family, 3)
    chunks = build_model_chunks(make_config(family), state, init_seed=INIT_SEED)
    loss = run_pipeline_step(chunks, state, "none", microbatches(3), num_microbatches=3, seq_length=SEQ,
                             micro_batch_size=MICRO_BATCH, hidden_size=HIDDEN, forward_step=gpt_forward_step)
    assert_rel_close(loss, reference["loss"], TOL, f"{family} p=1 loss")
    compare_grads([gather_full_weights(chunks[0], grads=True)], reference, f"{family} p=1")


def test_deallocated_output_still_backpropagates():
    x = torch.randn(4, 3, requires_grad=True)
    w = torch.randn(3, 3, requires_grad=True)
    out = x @ w + x
    sent = out.detach()
    deallocate_output(out)
    assert out.shape == (4, 3) and out.untyped_storage().nbytes() == out.element_size()
    assert sent.untyped_storage().nbytes() == 12 * sent.element_size()  # the alias keeps the bytes
    grad = torch.randn(4, 3)
    torch.autograd.backward(out, grad)
    assert torch.allclose(x.grad, grad @ w.t() + grad) and torch.allclose(w.grad, x.detach().t() @ grad)


def _state(p, v, rank=0):
    return ParallelState(ParallelLayout(p, pipeline=p, virtual_pipeline=v), rank)


def _executor(state, schedule, m, chunks=None):
    chunks = chunks if chunks is not None else build_model_chunks(make_config("gpt2"), state)
    return PipelineExecutor(chunks, state, schedule, num_microbatches=m, seq_length=SEQ,
                            micro_batch_size=MICRO_BATCH, hidden_size=HIDDEN, forward_step=gpt_forward_step)


def test_start_up_errors_name_the_flags():
    with pytest.raises(ValueError, match="--num-layers 8 is not divisible by "
                                         "--pipeline-model-parallel-size 3"):
        build_model_chunks(make_config("gpt2"), _state(3, 1))
    with pytest.raises(ValueError, match="--num-layers 8 is not divisible by .* 4 x "
                                         "--num-virtual-stages-per-pipeline-rank 4"):
        build_model_chunks(make_config("gpt2"), _state(4, 4))
    with pytest.raises(ValueError, match="--decoder-first-pipeline-num-layers 3 is not divisible by "
                                         "--num-virtual-stages-per-pipeline-rank 2"):
        build_model_chunks(make_config("gpt2"), _state(2, 2), num_layers_first=3)
    with pytest.raises(ValueError, match="must be a multiple of 4, got 6"):
        _executor(_state(4, 2), "interleaved_1f1b", 6)
    with pytest.raises(ValueError, match="interleaved_1f1b needs --pipeline-model-parallel-size >= 2 "
                                         "and --num-virtual-stages-per-pipeline-rank >= 2"):
        _executor(_state(2, 1), "interleaved_1f1b", 4)
    with pytest.raises(ValueError, match="runs one chunk per rank"):
        _executor(_state(2, 2), "1f1b", 4)
    state = _state(2, 2)
    with pytest.raises(ValueError, match="got 1 model chunks but "
                                         "--num-virtual-stages-per-pipeline-rank is 2"):
        _executor(state, "interleaved_1f1b", 4, build_model_chunks(make_config("gpt2"), state)[:1])
    wrong_order = build_model_chunks(make_config("gpt2"), state)[::-1]
    with pytest.raises(ValueError, match="chunk 0 of pipeline rank 0 has pre_process=False"):
        _executor(state, "interleaved_1f1b", 4, wrong_order)
    with pytest.raises(ValueError, match="needs an iterator of micro-batches"):
        _executor(state, "interleaved_1f1b", 4).run(None)


def test_short_data_iterator_is_named():
    state = ParallelState.single()
    with pytest.raises(ValueError, match="iterator ended after 2 of 3 micro-batches"):
        _executor(state, "none", 3).run(microbatches(2))


@pytest.mark.parametrize("name, p, v, m", [("gpipe", 4, 1, 5), ("1f1b", 4, 1, 8), ("zb_h1", 4, 1, 6),
                                           ("interleaved_1f1b", 4, 2, 8), ("interleaved_1f1b", 2, 4, 4)])
def test_eager_order(name, p, v, m):
    """Each send right after its producer, each receive one compute earlier, sends and receives
    each in listed order; run as the executor runs them on gloo, every transfer pairs and
    nothing deadlocks."""
    listed = all_ranks(name, p, m, v)
    eager = [eager_order(actions) for actions in listed]

    def computes_before(actions, action):
        return sum(a.is_compute for a in actions[:actions.index(action)])

    for before, after in zip(listed, eager):
        assert sorted(map(str, before)) == sorted(map(str, after))
        for kind in ("is_send", "is_compute"):
            assert [a for a in before if getattr(a, kind)] == [a for a in after if getattr(a, kind)]
        receives = [[a for a in actions if a.is_comm and not a.is_send] for actions in (before, after)]
        assert receives[0] == receives[1]
        for i, action in enumerate(after):
            if action.is_send:
                producer = {SEND_F: F, SEND_B: B}[action.kind]
                assert after[i - 1] == Action(producer, action.chunk, action.microbatch)
            elif action.is_comm:  # a receive: one compute action earlier than listed
                assert computes_before(after, action) == max(computes_before(before, action) - 1, 0)
    _run_as_executor(eager, p, v)


def _run_as_executor(lists, p, v):
    """Run every rank's list the way the executor does with gloo: transfers are posted when
    reached and never hold the rank; a compute waits only for the receive it reads, which
    completes once the peer has posted the matching send (the i-th send from a to b pairs
    with b's i-th receive from a). Raises AssertionError on a mismatch or a deadlock."""
    sends, receives = {}, {}  # (src, dst) -> posted, in order, named as the receiver names them
    where = {}                # (rank, receive action) -> (channel, index in it)
    position = [0] * p
    needs = {F: RECV_F, B: RECV_B}

    def advance(rank) -> bool:
        moved = False
        while position[rank] < len(lists[rank]):
            action = lists[rank][position[rank]]
            if action.is_comm:
                other, expected = peer(action, rank, p, v)
                if action.is_send:
                    sends.setdefault((rank, other), []).append(expected)
                else:
                    channel = receives.setdefault((other, rank), [])
                    where[(rank, action)] = ((other, rank), len(channel))
                    channel.append(action)
            elif action.kind in needs and _has_peer(rank, action, p, v):
                needed = Action(needs[action.kind], action.chunk, action.microbatch)
                assert (rank, needed) in where, f"rank {rank}: {action} before its receive"
                channel, index = where[(rank, needed)]
                if index >= len(sends.get(channel, [])):
                    return moved  # the matching send is not posted yet
                assert sends[channel][index] == needed, f"mismatched transfer on {channel}"
            position[rank] += 1
            moved = True
        return moved

    while any([advance(rank) for rank in range(p)]):
        pass
    stuck = [(rank, str(lists[rank][position[rank]])) for rank in range(p)
             if position[rank] < len(lists[rank])]
    assert not stuck, f"deadlock: {stuck}"


def _has_peer(rank, action, p, v):
    """Whether a compute reads a transfer (not F of the first or B of the last stage)."""
    stage, last = action.chunk * p + rank, p * v - 1
    return (action.kind == F and stage > 0) or (action.kind == B and stage < last)


def test_executor_model_catches_bad_lists():
    one = all_ranks("1f1b", 2, 1, 1)  # rank 0 sending its activation after its backward
    late = [a for a in one[0] if a != Action(SEND_F, 0, 0)] + [Action(SEND_F, 0, 0)]
    with pytest.raises(AssertionError, match="deadlock"):
        _run_as_executor([late, one[1]], 2, 1)
    lists = all_ranks("1f1b", 2, 3, 1)
    receives = [a for a in lists[1] if a.kind == RECV_F]
    swapped = [receives[1] if a == receives[0] else receives[0] if a == receives[1] else a
               for a in lists[1]]
    with pytest.raises(AssertionError, match="before its receive|mismatched"):
        _run_as_executor([lists[0], swapped], 2, 1)


@pytest.mark.parametrize("name, p, v, m", [("gpipe", 4, 1, 3), ("1f1b", 4, 1, 8), ("zb_h1", 8, 1, 5),
                                           ("interleaved_1f1b", 4, 2, 8), ("interleaved_1f1b", 2, 4, 4),
                                           ("interleaved_1f1b", 8, 2, 16)])
def test_forward_only_lists_run(name, p, v, m):
    """Evaluation runs a schedule's forwards and activation transfers alone: as listed, they
    neither deadlock nor mismatch even when every send waits for its receive (NCCL's rule),
    and reordered for gloo they run as the executor runs them."""
    def forward_part(actions):
        return [a for a in actions if a.kind in (F, SEND_F, RECV_F)]

    listed = all_ranks(name, p, m, v)
    simulate([forward_part(actions) for actions in listed], v, rendezvous=True)
    _run_as_executor([forward_part(eager_order(actions)) for actions in listed], p, v)
