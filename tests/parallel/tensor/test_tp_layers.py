"""Tensor-parallel layers and cross-entropy against their unsharded twins
(nn.Linear / F.embedding / F.cross_entropy), at TP = 1, 2 and 4, with and without sequence
parallelism. fp32; tolerance 1e-5 relative to the reference's largest magnitude."""

import pytest
import torch
import torch.nn.functional as F

from megalite.parallel import comm
from megalite.parallel.random import MODEL_PARALLEL_RNG, RNGTracker, seed_everything
from megalite.parallel.sharding import all_reduce_sequence_parallel_grads, full_from_shards, shard_of_full
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from tests.distributed import run_distributed
from tests.numerics import rel_error
from tests.parallel.refusals import value_error_messages

TOL = 1e-5
S, B, IN, OUT = 8, 2, 12, 16


def _gen(seed):
    return torch.Generator().manual_seed(seed)


def _gather(t, group, dim, stride=1):
    n = comm.group_size(group)
    if n == 1:
        return t
    shards = [torch.empty_like(t) for _ in range(n)]
    torch.distributed.all_gather(shards, t.contiguous(), group=group)
    return full_from_shards(shards, dim, stride)


def _linear_cases(group):
    """Relative errors of each parallel linear configuration against nn.Linear."""
    rank, tp = comm.group_rank(group), comm.group_size(group)
    x = torch.randn(S, B, IN, generator=_gen(1))
    gy_col = torch.randn(S, B, OUT, generator=_gen(2))
    errors = {}
    for kind in ("column", "column_gather", "column_sp", "column_stride2", "row", "row_scatter", "row_sp"):
        sp = kind.endswith("_sp")
        stride = 2 if kind == "column_stride2" else 1
        if kind.startswith("column"):
            layer = ColumnParallelLinear(IN, OUT, tp_group=group, gather_output=kind == "column_gather",
                                         sequence_parallel=sp, stride=stride)
            ref = torch.nn.Linear(IN, OUT)
        else:
            layer = RowParallelLinear(OUT, IN, tp_group=group, input_is_parallel=kind != "row_scatter",
                                      sequence_parallel=sp)
            ref = torch.nn.Linear(OUT, IN)
        layer.reset_parameters(_gen(3))
        # init: shards are exact slices of the full (TP=1) initialisation
        full_w = ColumnParallelLinear(IN, OUT) if kind.startswith("column") else RowParallelLinear(OUT, IN)
        full_w.reset_parameters(_gen(3))
        dim = 0 if kind.startswith("column") else 1
        errors[f"{kind}/init"] = rel_error(layer.weight, shard_of_full(full_w.weight, dim, stride, rank, tp))
        with torch.no_grad():
            ref.weight.copy_(full_w.weight)
            ref.bias.copy_(torch.randn(ref.bias.shape, generator=_gen(4)))
            layer.bias.copy_(shard_of_full(ref.bias, 0, stride, rank, tp) if dim == 0 else ref.bias)

        inp = x if kind.startswith("column") else torch.randn(S, B, OUT, generator=_gen(5))
        inp_ref = inp.clone().requires_grad_(True)
        y_ref = ref(inp_ref)
        gy = gy_col if kind.startswith("column") else torch.randn(S, B, IN, generator=_gen(6))
        (y_ref * gy).sum().backward()

        if sp and kind.startswith("column"):
            inp_local = comm.split_dim(inp, 0, group)
        elif kind in ("row", "row_sp"):
            inp_local = comm.split_dim(inp, -1, group)
        else:
            inp_local = inp
        inp_local = inp_local.clone().requires_grad_(True)
        y = layer(inp_local)
        if kind in ("column", "column_sp", "column_stride2"):
            y_full = _gather(y, group, -1, stride)
            gy_local = shard_of_full(gy, 2, stride, rank, tp)
        elif kind == "row_sp":
            y_full = _gather(y, group, 0)
            gy_local = comm.split_dim(gy, 0, group)
        else:
            y_full, gy_local = y, gy
        errors[f"{kind}/out"] = rel_error(y_full, y_ref)
        (y * gy_local).sum().backward()
        all_reduce_sequence_parallel_grads(layer.parameters(), group)
        gx = inp_local.grad
        if sp and kind.startswith("column"):
            gx = _gather(gx, group, 0)
        if kind in ("row", "row_sp"):
            gx = _gather(gx, group, -1)
        errors[f"{kind}/grad_x"] = rel_error(gx, inp_ref.grad)
        errors[f"{kind}/grad_w"] = rel_error(_gather(layer.weight.grad, group, dim, stride), ref.weight.grad)
        gb = layer.bias.grad if dim == 1 else _gather(layer.bias.grad, group, 0, stride)
        errors[f"{kind}/grad_b"] = rel_error(gb, ref.bias.grad)
    return errors


def _saved_activation_bytes(group, sequence_parallel: bool) -> tuple[int, int]:
    """(bytes of the non-parameter tensors a ColumnParallelLinear saves for backward, bytes of its
    input): under sequence parallelism only the input's sequence shard is kept, never the
    all-gathered input (which backward gathers again)."""
    layer = ColumnParallelLinear(IN, OUT, tp_group=group, sequence_parallel=sequence_parallel)
    layer.reset_parameters(_gen(3))
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    x = torch.randn(S // comm.group_size(group) if sequence_parallel else S, B, IN, generator=_gen(1),
                    requires_grad=True)
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = layer(x)
    y.sum().backward()  # the re-gathering backward runs
    return sum(saved.values()), x.nbytes


def _embedding_cases(group):
    vocab = 24
    ids = torch.randint(0, vocab, (S, B), generator=_gen(7))
    gy = torch.randn(S, B, IN, generator=_gen(8))
    errors = {}
    for sp in (False, True):
        emb = VocabParallelEmbedding(vocab, IN, tp_group=group, sequence_parallel=sp)
        emb.reset_parameters(_gen(9))
        full = VocabParallelEmbedding(vocab, IN)
        full.reset_parameters(_gen(9))
        w_ref = full.weight.detach().clone().requires_grad_(True)
        y_ref = F.embedding(ids, w_ref)
        (y_ref * gy).sum().backward()
        y = emb(ids)
        gy_local = comm.split_dim(gy, 0, group) if sp else gy
        (y * gy_local).sum().backward()
        errors[f"embedding_sp{sp}/out"] = rel_error(_gather(y, group, 0) if sp else y, y_ref)
        errors[f"embedding_sp{sp}/grad_w"] = rel_error(_gather(emb.weight.grad, group, 0), w_ref.grad)
    return errors


def _cross_entropy_cases(group):
    """Vocab-parallel CE vs F.cross_entropy over the true vocabulary (37 of 40 columns real)."""
    rank, tp = comm.group_rank(group), comm.group_size(group)
    vocab, padded, n = 37, 40, 10
    logits = torch.randn(n, padded, generator=_gen(10)) * 4
    target = torch.randint(0, vocab, (n,), generator=_gen(11))
    gl = torch.rand(n, generator=_gen(12))
    errors = {}
    for eps in (0.0, 0.1):
        ref_logits = logits[:, :vocab].clone().requires_grad_(True)
        ref = F.cross_entropy(ref_logits, target, reduction="none", label_smoothing=eps)
        (ref * gl).sum().backward()
        local = logits.chunk(tp, dim=-1)[rank].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, target, group, vocab_size=vocab, label_smoothing=eps)
        (loss * gl).sum().backward()
        grad = _gather(local.grad, group, 1)
        errors[f"ce_eps{eps}/loss"] = rel_error(loss, ref)
        errors[f"ce_eps{eps}/grad"] = rel_error(grad[:, :vocab], ref_logits.grad)
        errors[f"ce_eps{eps}/pad_grad_is_zero"] = grad[:, vocab:].abs().max().item()
        # bf16 logits: computed in fp32 internally, gradient returned in bf16
        bf = local.detach().bfloat16().requires_grad_(True)
        loss_bf = vocab_parallel_cross_entropy(bf, target, group, vocab_size=vocab, label_smoothing=eps)
        loss_bf.sum().backward()
        errors[f"ce_eps{eps}/bf16_grad_dtype_ok"] = 0.0 if bf.grad.dtype == torch.bfloat16 else 1.0
    errors.update(_huge_logit_cases(group, vocab, padded))
    return errors


def _huge_logit_cases(group, vocab, padded):
    """Logits of +-1e4 that live in one rank's shard: the max is found across ranks, nothing
    overflows, and huge padding columns are still ignored."""
    rank, tp = comm.group_rank(group), comm.group_size(group)
    logits = torch.randn(6, padded, generator=_gen(13))
    logits[0, 3] = 1e4            # first shard's logit dominates, target in the last shard
    logits[1, 30] = 1e4           # last shard's logit dominates, target in the first shard
    logits[2, 5] = 1e4            # the dominant logit is the target
    logits[3, [2, 33]] = 1e4      # a tie between the first and the last shard
    logits[4, :] = -1e4
    logits[4, 21] = 0.0           # every logit hugely negative but one
    logits[5, 3] = 1e4
    logits[5, vocab:] = 3e4       # padding columns larger still
    target = torch.tensor([34, 1, 5, 2, 21, 7])
    errors = {}
    for eps in (0.0, 0.1):
        ref_logits = logits[:, :vocab].clone().requires_grad_(True)
        ref = F.cross_entropy(ref_logits, target, reduction="none", label_smoothing=eps)
        ref.sum().backward()
        local = logits.chunk(tp, dim=-1)[rank].clone().requires_grad_(True)
        loss = vocab_parallel_cross_entropy(local, target, group, vocab_size=vocab, label_smoothing=eps)
        loss.sum().backward()
        grad = _gather(local.grad, group, 1)
        errors[f"ce_huge_eps{eps}/loss"] = rel_error(loss, ref)
        errors[f"ce_huge_eps{eps}/grad"] = rel_error(grad[:, :vocab], ref_logits.grad)
        errors[f"ce_huge_eps{eps}/pad_grad_is_zero"] = grad[:, vocab:].abs().max().item()
        errors[f"ce_huge_eps{eps}/finite"] = 0.0 if torch.isfinite(loss).all() and torch.isfinite(grad).all() else 1.0
    return errors


def _rng_cases(state):
    """TP stream differs per TP rank, default stream is shared across the TP group."""
    tracker = seed_everything(1234, tp_rank=state.tp_rank, pp_rank=state.pp_rank)
    shared = torch.rand(4)
    with tracker.fork(MODEL_PARALLEL_RNG):
        per_rank = torch.rand(4)
    after = torch.rand(4)  # the default stream continues as if the fork never happened
    seed_everything(1234, tp_rank=state.tp_rank)
    torch.rand(4)
    expected_after = torch.rand(4)
    return {"shared": shared, "per_rank": per_rank, "after_ok": torch.equal(after, expected_after)}


def _refusal_messages(group):
    return value_error_messages(lambda: ColumnParallelLinear(8, 6, tp_group=group),
                                lambda: RowParallelLinear(6, 8, tp_group=group),
                                lambda: VocabParallelEmbedding(6, 8, tp_group=group))


def _worker(rank, world_size):
    results = {}
    for tp in (2, 4):
        state = ParallelState.create(ParallelLayout(world_size, tensor=tp))
        errors = {**_linear_cases(state.tp_group), **_embedding_cases(state.tp_group),
                  **_cross_entropy_cases(state.tp_group)}
        results[tp] = {"errors": errors, "rng": _rng_cases(state), "tp_rank": state.tp_rank,
                       "refusals": _refusal_messages(state.tp_group),
                       "saved": {sp: _saved_activation_bytes(state.tp_group, sp) for sp in (False, True)}}
    return results


def _check(errors):
    assert len(errors) > 40
    bad = {k: v for k, v in errors.items() if v > TOL}
    assert not bad, f"relative errors above {TOL}: {bad}"


def test_layers_and_cross_entropy_single_process():
    _check({**_linear_cases(None), **_embedding_cases(None), **_cross_entropy_cases(None)})


@pytest.fixture(scope="module")
def tp_results():
    return run_distributed(_worker, 4)


def test_layers_and_cross_entropy_tp2_tp4(tp_results):
    results = tp_results
    for tp in (2, 4):
        for r in results:
            _check(r[tp]["errors"])
            assert r[tp]["rng"]["after_ok"]
        # default stream identical across all ranks; TP stream distinct across a TP group
        assert all(torch.equal(r[tp]["rng"]["shared"], results[0][tp]["rng"]["shared"]) for r in results)
        group = [r for r in results if r[tp]["tp_rank"] in range(tp)][:tp]
        streams = [r[tp]["rng"]["per_rank"] for r in group]
        assert len({tuple(s.tolist()) for s in streams}) == tp


def test_column_parallel_linear_saves_the_input_shard_under_sequence_parallelism(tp_results):
    for tp in (2, 4):
        for r in tp_results:
            saved, shard = r[tp]["saved"][True]
            assert saved == shard, f"TP={tp} SP: saved {saved} bytes, the input's shard is {shard}"
            saved, replicated = r[tp]["saved"][False]
            assert saved == replicated, f"TP={tp}: saved {saved} bytes, the (replicated) input is {replicated}"


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))])
def test_rng_tracker_streams(device):
    """add, fork and get_states/set_states on the device's default generator; a CUDA tracker
    leaves the CPU generator alone."""
    def draws(generator=None):
        return torch.rand(6, device=device, generator=generator)

    def seeded(seed):
        return torch.Generator(device).manual_seed(seed)

    torch.manual_seed(5)
    cpu_state = torch.get_rng_state()
    default = seeded(5)
    tracker = RNGTracker(device)
    assert tracker.device.type == device and (device == "cpu" or tracker.device.index is not None)
    tracker.add(MODEL_PARALLEL_RNG, 11)
    tracker.add("other", 12)
    with pytest.raises(ValueError, match="already exists"):
        tracker.add("other", 13)
    with pytest.raises(KeyError, match="never added"):
        with tracker.fork("missing"):
            pass
    assert torch.equal(draws(), draws(default)), "add() moved the default stream"
    stream = seeded(11)
    with tracker.fork():
        assert torch.equal(draws(), draws(stream))
    assert torch.equal(draws(), draws(default)), "the default stream did not resume after fork()"
    snapshot = tracker.get_states()
    with tracker.fork():
        first = draws()
        assert torch.equal(first, draws(stream)), "the forked stream did not continue"
    assert not torch.equal(snapshot[MODEL_PARALLEL_RNG], tracker.get_states()[MODEL_PARALLEL_RNG])
    tracker.set_states(snapshot)
    with tracker.fork():
        assert torch.equal(draws(), first), "set_states did not rewind the stream"
    with tracker.fork("other"):
        assert torch.equal(draws(), draws(seeded(12)))
    assert torch.equal(draws(), draws(default))
    if device == "cuda":
        assert torch.equal(torch.get_rng_state(), cpu_state), "a CUDA tracker moved the CPU generator"


def test_cross_entropy_is_stable_for_huge_logits():
    logits = torch.tensor([[1e4, 0.0, -1e4], [50.0, 50.0, 50.0]])
    target = torch.tensor([0, 2])
    loss = vocab_parallel_cross_entropy(logits, target)
    torch.testing.assert_close(loss, F.cross_entropy(logits, target, reduction="none"), rtol=0, atol=1e-6)
    assert torch.isfinite(loss).all()


def test_indivisible_sizes_are_refused(tp_results):
    assert tp_results[0][4]["refusals"] == [
        "ColumnParallelLinear: output size 6 is not divisible by TP size 4 x stride 1",
        "RowParallelLinear: input size 6 is not divisible by TP size 4",
        "VocabParallelEmbedding: vocabulary 6 is not divisible by TP size 4",
    ]
    with pytest.raises(ValueError, match="output size 6 is not divisible by TP size 1 x stride 4"):
        ColumnParallelLinear(8, 6, stride=4)
