import pytest
import torch.distributed as dist

from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed


def test_megatron_rank_order():
    layout = ParallelLayout(16, tensor=2, pipeline=4)
    assert layout.data == 2
    # TP innermost, then DP, then PP (Megatron's order).
    assert layout.tp_groups()[:2] == [[0, 1], [2, 3]]
    assert layout.dp_groups()[:2] == [[0, 2], [1, 3]]
    assert layout.pp_groups()[0] == [0, 4, 8, 12]
    assert layout.mp_groups()[0] == [0, 1, 4, 5, 8, 9, 12, 13]
    assert layout.embedding_groups()[0] == [0, 12]
    for rank in range(16):
        assert layout.rank_of(*layout.coords(rank)) == rank
    # every dimension partitions the world
    for groups in (layout.tp_groups(), layout.dp_groups(), layout.pp_groups(), layout.mp_groups()):
        assert sorted(r for g in groups for r in g) == list(range(16))


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_size=6, tensor=4), "world size 6 is not divisible by --tensor-model-parallel-size 4"),
    (dict(world_size=8, tensor=2, pipeline=3), "x --pipeline-model-parallel-size 3 = 6"),
    (dict(world_size=4, tensor=0), "--tensor-model-parallel-size must be a positive integer"),
    (dict(world_size=4, virtual_pipeline=2), "--num-virtual-stages-per-pipeline-rank 2 needs"),
])
def test_impossible_layouts_refused_before_any_group(kwargs, message, monkeypatch):
    _forbid_process_groups(monkeypatch)
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        ParallelLayout(**kwargs)


def _forbid_process_groups(monkeypatch):
    """Make every way of creating a process group raise, so a refusal that reaches one fails
    with this message instead of the expected ValueError."""
    def forbidden(*args, **kwargs):
        raise AssertionError("a process group was requested before the layout was validated")
    for name in ("init_process_group", "new_group", "new_subgroups_by_enumeration", "new_subgroups"):
        monkeypatch.setattr(dist, name, forbidden)


@pytest.mark.parametrize("model, message", [
    (dict(num_layers=4, hidden_size=64, num_attention_heads=6), "--hidden-size 64 is not divisible by --num-attention-heads 6"),
    (dict(num_layers=4, hidden_size=96, num_attention_heads=6), "--num-attention-heads 6 is not divisible by --tensor-model-parallel-size 4"),
    (dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=2), "--num-query-groups 2 is not divisible by --tensor-model-parallel-size 4"),
    (dict(num_layers=4, hidden_size=64, num_attention_heads=8, num_query_groups=3), "--num-attention-heads 8 is not divisible by --num-query-groups 3"),
])
def test_model_shape_checks_name_flags(model, message, monkeypatch):
    _forbid_process_groups(monkeypatch)
    with pytest.raises(ValueError, match=message):
        ParallelLayout(8, tensor=4, pipeline=2).check_model(**model)


def test_validation_would_have_failed_on_a_group_request(monkeypatch):
    """The guard above is live: creating a state for a multi-process layout asks for groups."""
    _forbid_process_groups(monkeypatch)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)
    with pytest.raises(AssertionError, match="process group was requested"):
        ParallelState.create(ParallelLayout(2, tensor=2))


def _groups_worker(rank, world_size):
    layout = ParallelLayout(world_size, tensor=2, pipeline=2)
    ps = ParallelState.create(layout)
    return {
        "coords": (ps.tp_rank, ps.dp_rank, ps.pp_rank),
        "tp": dist.get_process_group_ranks(ps.tp_group),
        "dp": dist.get_process_group_ranks(ps.dp_group),
        "pp": dist.get_process_group_ranks(ps.pp_group),
        "mp": dist.get_process_group_ranks(ps.mp_group),
        "emb": dist.get_process_group_ranks(ps.embedding_group),
        "next": ps.next_rank, "prev": ps.prev_rank, "src": ps.tp_src_rank,
        "first": ps.is_first_stage, "last": ps.is_last_stage,
    }


def test_process_groups_match_layout():
    results = run_distributed(_groups_worker, 8)
    layout = ParallelLayout(8, tensor=2, pipeline=2)
    for rank, r in enumerate(results):
        tp, dp, pp = layout.coords(rank)
        assert r["coords"] == (tp, dp, pp)
        assert r["tp"] == [layout.rank_of(t, dp, pp) for t in range(2)]
        assert r["dp"] == [layout.rank_of(tp, d, pp) for d in range(2)]
        assert r["pp"] == [layout.rank_of(tp, dp, p) for p in range(2)]
        assert rank in r["mp"] and len(r["mp"]) == 4
        assert r["emb"] == r["pp"]
        assert r["next"] == r["prev"] == layout.rank_of(tp, dp, 1 - pp)
        assert r["src"] == layout.rank_of(0, dp, pp)
        assert (r["first"], r["last"]) == (pp == 0, pp == 1)


def test_context_parallel_rank_order():
    """Megatron's tp-cp-dp-pp order, and tp-cp-pp-dp with --use-tp-pp-dp-mapping."""
    layout = ParallelLayout(16, tensor=2, pipeline=2, context=2)
    assert layout.data == 2
    assert layout.tp_groups()[:2] == [[0, 1], [2, 3]]
    assert layout.cp_groups()[:2] == [[0, 2], [1, 3]]
    assert layout.dp_groups()[:2] == [[0, 4], [1, 5]]
    assert layout.dp_cp_groups()[0] == [0, 2, 4, 6]
    assert layout.pp_groups()[0] == [0, 8]
    assert layout.mp_groups()[0] == [0, 1, 8, 9]
    mapped = ParallelLayout(16, tensor=2, pipeline=2, context=2, tp_pp_dp_mapping=True)
    assert mapped.cp_groups()[0] == [0, 2] and mapped.pp_groups()[0] == [0, 4] and mapped.dp_groups()[0] == [0, 8]
    for lay in (layout, mapped):
        for rank in range(16):
            tp, dp, pp = lay.coords(rank)
            assert lay.rank_of(tp, dp, pp, lay.cp_rank_of(rank)) == rank
        for groups in (lay.tp_groups(), lay.cp_groups(), lay.dp_groups(), lay.pp_groups(), lay.dp_cp_groups()):
            assert sorted(r for g in groups for r in g) == list(range(16))
    with pytest.raises(ValueError, match="x --context-parallel-size 4 x"):
        ParallelLayout(8, tensor=1, context=4, pipeline=4)
