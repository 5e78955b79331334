"""Layer -> (pipeline rank, chunk) assignment and the start-up errors for impossible splits."""

from types import SimpleNamespace

import pytest

from megalite.parallel.pipeline.stage_layout import (layer_owners, layers_per_virtual_stage, stage_layers,
                                                     validate_pipeline, virtual_stages_per_rank)


def test_round_robin_chunks_as_in_megatron():
    # p=2, v=2, 8 layers: chunk c of rank r holds block c*p + r.
    assert [list(stage_layers(8, 2, r, c, 2)) for r in (0, 1) for c in (0, 1)] == [
        [0, 1], [4, 5], [2, 3], [6, 7]]
    assert layer_owners(8, 2, 2) == [(0, 0), (0, 0), (1, 0), (1, 0),
                                     (0, 1), (0, 1), (1, 1), (1, 1)]
    assert list(stage_layers(12, 1, 0)) == list(range(12))


@pytest.mark.parametrize("num_layers,p,v,first,last", [
    (24, 4, 1, None, None), (24, 4, 2, None, None), (24, 2, 4, None, None), (12, 3, 2, None, None),
    (10, 4, 1, 1, 3), (10, 4, 1, 4, None), (10, 4, 1, None, 1), (14, 4, 2, 2, 4),
    (16, 4, 2, 4, None), (16, 4, 2, None, 4), (12, 2, 2, 4, 8), (12, 2, 1, 5, None),
])
def test_layers_cover_the_model_once_in_stage_order(num_layers, p, v, first, last):
    counts = layers_per_virtual_stage(num_layers, p, v, first, last)
    assert sum(counts) == num_layers and min(counts) >= 1
    owners = layer_owners(num_layers, p, v, first, last)
    # Walking the layers in order visits virtual stages 0, 1, ..., p*v-1 in contiguous blocks.
    stages = [chunk * p + rank for rank, chunk in owners]
    assert stages == sorted(stages) and set(stages) == set(range(p * v))
    for rank in range(p):
        held = sum(len(stage_layers(num_layers, p, rank, c, v, first, last)) for c in range(v))
        if first is not None and rank == 0:
            assert held == first
        if last is not None and rank == p - 1:
            assert held == last


def test_offsets_match_megatron_core():
    """Oracle: megatron-core's get_transformer_layer_offset gives the same first layer for
    every (rank, chunk), even and uneven, with and without virtual stages."""
    layer = pytest.importorskip("megatron.core.transformer.transformer_layer")
    for num_layers, p, v, first, last in [(24, 4, 1, None, None), (24, 4, 2, None, None),
                                          (10, 4, 1, 1, 3), (14, 4, 2, 2, 4), (16, 4, 2, 4, None),
                                          (16, 4, 2, None, 4), (28, 8, 2, 2, 2)]:
        # (Megatron divides by zero when uneven first and last leave no middle rank with v > 1.)
        config = SimpleNamespace(
            num_layers=num_layers, pipeline_model_parallel_size=p,
            virtual_pipeline_model_parallel_size=v if v > 1 else None,
            pipeline_model_parallel_layout=None, num_layers_in_first_pipeline_stage=first,
            num_layers_in_last_pipeline_stage=last, account_for_embedding_in_pipeline_split=False,
            account_for_loss_in_pipeline_split=False)
        for rank in range(p):
            for chunk in range(v):
                expected = layer.get_transformer_layer_offset(
                    config, vp_stage=chunk if v > 1 else None, pp_rank=rank)
                got = stage_layers(num_layers, p, rank, chunk, v, first, last).start
                assert got == expected, (num_layers, p, v, first, last, rank, chunk)


@pytest.mark.parametrize("args,match", [
    ((10, 4, 1), r"--num-layers 10 is not divisible by --pipeline-model-parallel-size 4 x "
                 r"--num-virtual-stages-per-pipeline-rank 1 = 4"),
    ((12, 4, 2), r"--num-layers 12 .* 4 x --num-virtual-stages-per-pipeline-rank 2 = 8"),
    ((12, 4, 2, 3), r"--decoder-first-pipeline-num-layers 3 is not divisible by "
                    r"--num-virtual-stages-per-pipeline-rank 2"),
    ((12, 4, 2, None, 1), r"--decoder-last-pipeline-num-layers 1 is not divisible"),
    ((12, 4, 1, 5), r"leaves 7 layers, not divisible by the 3 middle pipeline rank\(s\)"),
    ((12, 2, 1, 4, 4), r"leaves 4 of --num-layers 12 for the 0 other pipeline rank"),
    ((8, 4, 1, 4, 4), r"leaves 0 of --num-layers 8 for the 2 other pipeline rank"),
    ((8, 2, 1, 10), r"leaves -2 of --num-layers 8"),
    ((8, 1, 1, 4), r"^--decoder-first-pipeline-num-layers needs --pipeline-model-parallel-size > 1$"),
    ((8, 1, 1, 4, 4), r"^--decoder-first-pipeline-num-layers and --decoder-last-pipeline-num-layers "
                      r"need --pipeline-model-parallel-size > 1$"),
    ((8, 2, 1, 0), r"--decoder-first-pipeline-num-layers must be a positive integer, got 0"),
    ((0, 2, 1), r"--num-layers must be a positive integer"),
])
def test_impossible_splits_name_the_flags(args, match):
    with pytest.raises(ValueError, match=match):
        layers_per_virtual_stage(*args)


def test_virtual_stage_flags():
    assert virtual_stages_per_rank(24, 4) == 1
    assert virtual_stages_per_rank(24, 4, num_virtual_stages_per_pipeline_rank=3) == 3
    assert virtual_stages_per_rank(24, 4, num_layers_per_virtual_pipeline_stage=2) == 3
    with pytest.raises(ValueError, match=r"--num-layers 24 is not divisible by "
                                         r"--pipeline-model-parallel-size 4 x "
                                         r"--num-layers-per-virtual-pipeline-stage 4 = 16"):
        virtual_stages_per_rank(24, 4, num_layers_per_virtual_pipeline_stage=4)
    with pytest.raises(ValueError, match=r"--num-layers-per-virtual-pipeline-stage and "
                                         r"--num-virtual-stages-per-pipeline-rank contradict each "
                                         r"other \(give one\)"):
        virtual_stages_per_rank(24, 4, 2, 3)
    with pytest.raises(ValueError, match=r"--num-layers-per-virtual-pipeline-stage needs "
                                         r"--pipeline-model-parallel-size > 1"):
        virtual_stages_per_rank(24, 1, num_layers_per_virtual_pipeline_stage=2)
    with pytest.raises(ValueError, match=r"cannot be combined with --decoder-first"):
        virtual_stages_per_rank(24, 4, num_layers_per_virtual_pipeline_stage=2, uneven=True)


def test_validate_pipeline_checks_layers_and_microbatches_before_start():
    assert validate_pipeline(16, 4, 2, 8) == "interleaved_1f1b"
    assert validate_pipeline(16, 4, 1, 3) == "1f1b"
    assert validate_pipeline(16, 1, 1, 3) == "none"
    assert validate_pipeline(16, 4, 1, 3, "zb_h1") == "zb_h1"
    with pytest.raises(ValueError, match=r"interleaved_1f1b runs micro-batches in groups of "
                                         r"--pipeline-model-parallel-size 4, .* multiple of 4, got 6"):
        validate_pipeline(16, 4, 2, 6)
    with pytest.raises(ValueError, match=r"--num-layers 12 is not divisible"):
        validate_pipeline(12, 4, 2, 8)
