"""--account-for-embedding-in-pipeline-split / --account-for-loss-in-pipeline-split with virtual
pipeline stages: Megatron-LM's functional test gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_
loss_in_pipeline_split (6 layers over PP=4 x VP=2: the embedding and the loss count as layers, so
every virtual stage holds one layer and the first and last hold none).

Megatron's behaviour (megatron/core/transformer/transformer_block.py, get_num_layers_to_build;
transformer_layer.py, get_transformer_layer_offset): (L + 1 + 1) / (p*v) layers per virtual
stage, one fewer on virtual stage 0 (pp rank 0, vp stage 0) and on the last (pp rank p-1, vp
stage v-1). The layout is checked against megatron-core's own functions, and a 4-process run
of the interleaved schedule against the single-device model (loss and every gradient within
1e-5, fp32). The same harness runs a --pipeline-model-parallel-layout: PP2 x VP2 with the uneven
layout LAYOUT_STRING, parsed and validated from the command line (the counts setup_run builds with)."""

from types import SimpleNamespace

import pytest

from megalite.config.arguments import parse_args, validate_args
from megalite.config.megatron.training import split_accounting
from megalite.config.run_config import ParallelConfig
from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step
from megalite.model.weights import gather_full_weights
from megalite.parallel.pipeline.executor import PipelineExecutor
from megalite.parallel.pipeline.stage_layout import layers_per_virtual_stage, stage_layers
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.numerics import assert_rel_close
from tests.parallel.pipeline.pipeline_cases import (FAMILIES, HIDDEN, INIT_SEED, MICRO_BATCH, SEQ, TOL,
                                                    all_reduce_shared_embedding_grads, compare_grads,
                                                    make_config, microbatches, reference_run)

# (layers, p, v, embedding counted, loss counted)
LAYOUTS = [(6, 4, 2, True, True), (7, 4, 2, True, False), (7, 4, 2, False, True), (14, 4, 2, True, True),
           (10, 2, 3, True, True), (4, 2, 3, True, True)]


def test_six_layers_over_pp4_vp2_as_megatrons_functional_test():
    assert layers_per_virtual_stage(6, 4, 2, embedding_stage=True, loss_stage=True) == [0, 1, 1, 1, 1, 1, 1, 0]
    # chunk c of rank r is virtual stage c*p + r: rank 0 chunk 0 holds only the embedding,
    # rank 3 chunk 1 only the final norm and output layer
    assert [list(stage_layers(6, 4, r, c, 2, embedding_stage=True, loss_stage=True))
            for r in range(4) for c in range(2)] == [[], [3], [0], [4], [1], [5], [2], []]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_megatron_core(layout):
    """Oracle: megatron-core's get_num_layers_to_build and get_transformer_layer_offset."""
    block = pytest.importorskip("megatron.core.transformer.transformer_block")
    layer = pytest.importorskip("megatron.core.transformer.transformer_layer")
    num_layers, p, v, embedding, loss = layout
    config = SimpleNamespace(num_layers=num_layers, pipeline_model_parallel_size=p,
                             virtual_pipeline_model_parallel_size=v, pipeline_model_parallel_layout=None,
                             num_layers_in_first_pipeline_stage=None, num_layers_in_last_pipeline_stage=None,
                             account_for_embedding_in_pipeline_split=embedding,
                             account_for_loss_in_pipeline_split=loss)
    for rank in range(p):
        for chunk in range(v):
            held = stage_layers(num_layers, p, rank, chunk, v, embedding_stage=embedding, loss_stage=loss)
            assert len(held) == block.get_num_layers_to_build(config, vp_stage=chunk, pp_rank=rank), (rank, chunk)
            if len(held):
                assert held.start == layer.get_transformer_layer_offset(config, vp_stage=chunk, pp_rank=rank)


def test_flags_reach_the_parallel_config_and_refuse_what_megatron_refuses():
    argv = ("--num-layers 6 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
            "--global-batch-size 4 --train-iters 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
            "--vocab-size 64 --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
            "--account-for-embedding-in-pipeline-split --account-for-loss-in-pipeline-split").split()
    args = validate_args(parse_args(argv), 4)
    parallel = ParallelConfig.from_args(args, 4)
    assert (parallel.pipeline_embedding_stage, parallel.pipeline_loss_stage) == (True, True)
    assert (parallel.decoder_first_pipeline_num_layers, parallel.decoder_last_pipeline_num_layers) == (None, None)
    with pytest.raises(ValueError, match=r"--num-layers 7 plus the accounted embedding/loss \(9\) is not divisible "
                                         r"by --pipeline-model-parallel-size 4 x --num-virtual-stages-per-pipeline-"
                                         r"rank 2 = 8"):
        validate_args(parse_args([a if a != "6" else "7" for a in argv]), 4)
    with pytest.raises(ValueError, match="contradict each other"):
        validate_args(parse_args(argv + ["--decoder-first-pipeline-num-layers", "2"]), 4)


LAYOUT_STRING = "E|t*3|t|tL"  # stages in order: pp0/vp0 = E, pp1/vp0 = ttt, pp0/vp1 = t, pp1/vp1 = t and the loss
LAYOUT_ARGV = ("--num-layers 5 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --micro-batch-size 1 "
               "--global-batch-size 8 --train-iters 2 --lr 1e-3 --mock-data --tokenizer-type NullTokenizer "
               "--vocab-size 64 --pipeline-model-parallel-size 2").split() + ["--pipeline-model-parallel-layout",
                                                                              LAYOUT_STRING]


def test_layout_flag_reaches_the_parallel_config_and_refuses_the_other_splits():
    args = validate_args(parse_args(LAYOUT_ARGV), 4)
    parallel = ParallelConfig.from_args(args, 4)
    assert (parallel.layout.pipeline, parallel.layout.virtual_pipeline) == (2, 2)
    assert parallel.pipeline_layout_counts == (0, 3, 1, 1)
    validate_args(args, 4)  # a second validation finds the virtual stages it filled in
    for extra in (["--num-virtual-stages-per-pipeline-rank", "2"], ["--decoder-first-pipeline-num-layers", "1"],
                  ["--account-for-loss-in-pipeline-split"], ["--num-layers-per-virtual-pipeline-stage", "1"]):
        with pytest.raises(ValueError, match=f"--pipeline-model-parallel-layout and {extra[0]} contradict"):
            validate_args(parse_args(LAYOUT_ARGV + extra), 4)
    with pytest.raises(ValueError, match="^--pipeline-model-parallel-layout: 5 decoder layers t, --num-layers is 6$"):
        validate_args(parse_args([a if a != "5" else "6" for a in LAYOUT_ARGV]), 4)
    with pytest.raises(ValueError, match="^--pipeline-model-parallel-layout: megalite places m only on the last"):
        validate_args(parse_args(LAYOUT_ARGV[:-1] + ["E|t*3|ttm|L", "--mtp-num-layers", "1"]), 4)  # Megatron's standalone MTP
    single = validate_args(parse_args(LAYOUT_ARGV[:-1] + ["Ettt|ttL"]), 4)
    assert (single.num_virtual_stages_per_pipeline_rank, split_accounting(single)["layout_counts"]) == (None, [3, 2])


def _worker(rank, world_size):
    state = ParallelState.create(ParallelLayout(world_size, pipeline=4, virtual_pipeline=2))
    results = {family: _run(state, family) for family in FAMILIES}
    parallel = ParallelConfig.from_args(validate_args(parse_args(LAYOUT_ARGV), world_size), world_size)
    layout_state = ParallelState.create(parallel.layout)  # PP2 x VP2, two data-parallel replicas
    results.update({("layout", family): _run(layout_state, family, num_layers=5,
                                             layout_counts=parallel.pipeline_layout_counts) for family in FAMILIES})
    return results


def _run(state, family, num_layers=6, **split):
    config = make_config(family, num_layers=num_layers)
    chunks = build_model_chunks(config, state, init_seed=INIT_SEED,
                                **(split or {"embedding_stage": True, "loss_stage": True}))
    data = microbatches(4) if state.is_first_stage or state.is_last_stage else None
    executor = PipelineExecutor(chunks, state, "interleaved_1f1b", num_microbatches=4, seq_length=SEQ,
                                micro_batch_size=MICRO_BATCH, hidden_size=HIDDEN, forward_step=gpt_forward_step)
    loss = executor.run(data)
    all_reduce_shared_embedding_grads(chunks, state)
    grads = {}
    for chunk in chunks:
        grads.update(gather_full_weights(chunk, grads=True))
    return {"loss": loss, "grads": grads, "layers": [sorted(int(n) for n in chunk.layers) for chunk in chunks],
            "pp_rank": state.pp_rank}


@pytest.fixture(scope="module")
def pipelined():
    return run_distributed(_worker, 4)  # one spawn runs both families and both splits


@pytest.mark.parametrize("family", FAMILIES)
def test_pp4_vp2_run_matches_the_single_device_model(pipelined, family):
    ranks = [r[family] for r in pipelined]
    reference = reference_run(make_config(family, num_layers=6), [microbatches(4)])
    assert [r["layers"] for r in ranks] == [[[], [3]], [[0], [4]], [[1], [5]], [[2], []]]
    assert all(r["loss"] is None for r in ranks[:-1])
    assert_rel_close(ranks[-1]["loss"], reference["loss"], TOL, f"{family} loss")
    compare_grads([r["grads"] for r in ranks], reference, family)


@pytest.mark.parametrize("family", FAMILIES)
def test_pp2_vp2_uneven_layout_run_matches_the_single_device_model(pipelined, family):
    """Each data-parallel replica runs the same micro-batches (no data-parallel reduction here), so every
    rank's loss and gradients equal the single-device model's."""
    ranks = [r[("layout", family)] for r in pipelined]
    reference = reference_run(make_config(family, num_layers=5), [microbatches(4)])
    assert {r["pp_rank"]: r["layers"] for r in ranks} == {0: [[], [3]], 1: [[0, 1, 2], [4]]}
    for r in ranks:
        if r["pp_rank"] == 1:
            assert_rel_close(r["loss"], reference["loss"], TOL, f"{family} layout loss")
        else:
            assert r["loss"] is None
    compare_grads([r["grads"] for r in ranks], reference, f"{family} layout")
