"""--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split among the
model's flags: the planner enumerates the layouts pretrain_gpt accepts with them, and counts per
stage the layers the dry run builds (its parameters, activations and time), not the even split
it used before (which the flags, passed on in the printed command, did not give)."""

import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

import pytest

from megalite.config.arguments import model_config_from_args, parse_args, validate_args
from megalite.config.megatron.training import split_accounting
from megalite.model.pipeline_chunks import build_model_chunks
from megalite.parallel.state import ParallelLayout, ParallelState
from megalite.planner.layouts import Layout, Space, enumerate_layouts
from megalite.planner.memory import layer_activation_bytes, peak_memory, rank_memory
from megalite.planner.parameters import rank_parameters
from megalite.planner.compute import embedding_times
from megalite.planner.step import chunk_times
from megalite.planner.cluster import preset
from megalite.planner.workload import from_flags

MODEL = ("--num-layers 14 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --global-batch-size 16 "
         "--tokenizer-type NullTokenizer --vocab-size 999").split()
BOTH = ["--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split"]


def _dry_run_chunks(flags, layout: Layout, rank: int):
    """The chunks the dry run builds for pipeline rank `rank` (megalite/dryrun/runner.py's
    call, from the validated flags with the layout's), on the meta device; (layer numbers per
    chunk, dense parameters)."""
    args = parse_args(flags + layout.flags() + ["--train-iters", "1", "--lr", "0", "--mock-data"])
    validate_args(args, layout.world_size)
    config = model_config_from_args(args, 1000)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=layout.world_size)
    try:
        pstate = ParallelState.create(ParallelLayout(layout.world_size, tensor=layout.tp, pipeline=layout.pp,
                                                     virtual_pipeline=layout.vp))
        pstate.pp_rank = rank
        chunks = build_model_chunks(config, pstate, num_layers_first=args.decoder_first_pipeline_num_layers,
                                    num_layers_last=args.decoder_last_pipeline_num_layers, device="meta",
                                    **split_accounting(args))
        layers = [sorted(int(n) for n in chunk.layers.keys()) for chunk in chunks]
        return layers, sum(p.numel() for chunk in chunks for p in chunk.parameters())
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("extra, pp, vp, expected", [
    (BOTH, 4, 1, [[3], [4], [4], [3]]),  # (14 + 2) / 4 = 4 a stage, the first and last one fewer
    (BOTH, 4, 2, [[1, 2], [2, 2], [2, 2], [2, 1]]),  # per chunk: 16 / 8 = 2, virtual stages 0 and 7 one fewer
    (BOTH[:1], 3, 1, [[4], [5], [5]]),
    (BOTH[1:], 3, 1, [[5], [5], [4]]),
])
def test_planner_counts_the_layers_the_dry_run_builds(extra, pp, vp, expected):
    flags = MODEL + extra
    workload = from_flags(flags)
    layout = Layout(1, pp, 1, vp, schedule="interleaved_1f1b" if vp > 1 else "1f1b")
    assert layout in set(enumerate_layouts(workload, pp, Space(tp=[1], pp=[pp], vp=[vp], micro_batch_size=[1],
                                                               sequence_parallel=[False], recompute=["none"],
                                                               distributed_optimizer=[False])))
    cluster = preset("h200", pp)
    times = chunk_times(cluster, workload, layout)
    layer_forward = times[1][0].forward / expected[1][0]  # rank 1's first chunk: layers alone
    first_layers = times[0][0].forward - embedding_times(cluster, workload, layout).forward
    assert first_layers == pytest.approx(expected[0][0] * layer_forward)
    for rank in range(pp):
        layers, params = _dry_run_chunks(flags, layout, rank)
        assert [len(chunk) for chunk in layers] == expected[rank]
        assert sum(rank_parameters(workload.config, 1, pp, vp, rank, 1, workload.layer_split(pp, vp))) == params
        memory = rank_memory(workload, layout, rank)
        held_layers = memory.activations / layer_activation_bytes(workload, layout)
        assert held_layers == pytest.approx(memory.held_microbatches * sum(expected[rank]))
        for c in range(vp):
            if not (rank == 0 and c == 0) and not (rank == pp - 1 and c == vp - 1):
                assert times[rank][c].forward == pytest.approx(expected[rank][c] * layer_forward)
    assert peak_memory(workload, layout).total == max(rank_memory(workload, layout, r).total for r in range(pp))


def test_without_the_flags_the_even_split_and_its_layouts():
    """14 layers split over 4 or 8 stages only with both flags, over 2 without them or with both,
    over none with one."""
    plain, accounted = from_flags(MODEL), from_flags(MODEL + BOTH)
    space = Space(tp=[1], micro_batch_size=[1], sequence_parallel=[False], recompute=["none"],
                  distributed_optimizer=[False])
    plain_pp = {layout.pp for layout in enumerate_layouts(plain, 8, space)}
    accounted_pp = {(layout.pp, layout.vp) for layout in enumerate_layouts(accounted, 8, space)}
    assert plain_pp == {1, 2} and {(2, 1), (4, 1), (4, 2), (8, 1)} <= accounted_pp
    embedding_only = from_flags(MODEL + BOTH[:1])  # 15 counted layers: no even split over 2, 4 or 8 stages
    assert {layout.pp for layout in enumerate_layouts(embedding_only, 8, space)} == {1}
    assert plain.layer_split(2, 1) == {"first_stage_layers": None, "last_stage_layers": None,
                                       "embedding_stage": False, "loss_stage": False, "layout_counts": None}
    with pytest.raises(ValueError, match="--account-for-embedding-in-pipeline-split: --num-layers 14 plus"):
        accounted.layer_split(3, 1)
