"""The layout string parser against Megatron-Core's PipelineParallelLayerLayout on the same strings."""

import pytest

from megalite.parallel.pipeline.layout_string import LayoutError, build_layout, parse_stages, validate_layout

mcore_layout = pytest.importorskip("megatron.core.transformer.pipeline_parallel_layer_layout")
parallel_state = pytest.importorskip("megatron.core.parallel_state")

# (layout, pp, num_layers, mtp_num_layers): the MoE functional-test configs' strings and others.
VALID = [
    ("Et*3|(tt|)*29,m|L", 8, 61, 1),
    ("Et|(tt|)*6,mL", 2, 13, 1),
    ("Ettt|tt|tt|tttL", 4, 10, None),
    ("E|t*3|tt,t|tL", 2, 7, None),
    ("Et|t|t|tt|tt|L", 2, 7, None),
    ("E(t|)*3,mmL", 2, 3, 2),
    ("Et,t|t*2|(t)*2,m|L", 2, 6, 1),
]
INVALID = [
    ("Ett|tL", 2, 4, None, "decoder layers"),
    ("tE|tL", 2, 2, None, "first layer"),
    ("Et|tt", 2, 3, None, "last layer"),
    ("Et|mt|L", 3, 2, 1, "before MTP"),
    ("Et|tx|L", 3, 2, None, "invalid layer character"),
    ("Et|t|L", 2, 2, None, "not divisible"),
    ("Et|m|tt|L", 2, 3, 1, "MTP"),
]


def _mcore(layout, pp):
    return mcore_layout.PipelineParallelLayerLayout(layout, pp)


@pytest.mark.parametrize("layout,pp,num_layers,mtp", VALID)
def test_layer_ids_per_stage_equal_megatron_core(layout, pp, num_layers, mtp):
    from megatron.core.transformer.enums import LayerType

    theirs = _mcore(layout, pp)
    ours = build_layout(layout, pp)
    assert ours.virtual_size == theirs.virtual_pipeline_model_parallel_size
    assert validate_layout(ours, num_layers, mtp) == theirs.validate_layer_layout(num_layers, mtp)
    parallel_state.set_virtual_pipeline_model_parallel_world_size(
        ours.virtual_size if ours.virtual_size > 1 else None)
    try:
        for pp_rank in range(pp):
            for vp in range(ours.virtual_size):
                for kind in ("embedding", "decoder", "mtp", "loss"):
                    assert ours.layer_ids(kind, pp_rank, vp) == theirs.get_layer_id_list(
                        LayerType[kind], vp_stage=vp, pp_rank=pp_rank), (layout, pp_rank, vp, kind)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(None)


@pytest.mark.parametrize("layout,pp,num_layers,mtp,message", INVALID)
def test_refusals_match_megatron_core(layout, pp, num_layers, mtp, message):
    with pytest.raises((AssertionError, KeyError)):
        _mcore(layout, pp).validate_layer_layout(num_layers, mtp)
    with pytest.raises(LayoutError, match=message):
        validate_layout(build_layout(layout, pp), num_layers, mtp)


def test_parse_unrolls_repeats_like_megatron_core():
    for layout in ("xy(ab|cd|ef)*2,pq", "(ab)*3", "ab,(cd|)*2", "(|ab)*2,cd"):
        text = layout.replace("a", "E").replace("b", "t").replace("c", "m").replace("d", "L")
        text = text.replace("e", "t").replace("f", "m").replace("x", "E").replace("y", "t")
        text = text.replace("p", "m").replace("q", "L")
        theirs = [[kind.name for kind in stage]
                  for stage in mcore_layout.PipelineParallelLayerLayout.parse_str_to_list(text)]
        assert parse_stages(text) == theirs


def test_decoder_counts_per_virtual_stage_and_placement_refusals():
    from megalite.parallel.pipeline.layout_string import decoder_layers_per_virtual_stage

    # Megatron's MoE functional-test layout: PP 4, 8 strings -> 2 virtual stages per rank.
    assert decoder_layers_per_virtual_stage(build_layout("Et*3|(tt|)*6mL", 4)) == [3, 2, 2, 2, 2, 2, 2, 0]
    assert decoder_layers_per_virtual_stage(build_layout("Et|tt|t|ttL", 2)) == [1, 2, 1, 2]
    for layout, char in (("|Ett|tt|L", "E"), ("Et|tt|L|", "L"), ("Et|tt|tm|L", "m")):
        with pytest.raises(LayoutError, match=f"places {char} only"):
            decoder_layers_per_virtual_stage(build_layout(layout, 2))


def test_stage_layout_takes_the_layout_counts():
    from megalite.parallel.pipeline.layout_string import decoder_layers_per_virtual_stage
    from megalite.parallel.pipeline.stage_layout import layer_owners, stage_layers

    counts = decoder_layers_per_virtual_stage(build_layout("Et|tt|t|ttL", 2))
    assert [list(stage_layers(6, 2, r, c, 2, layout_counts=counts)) for c in range(2) for r in range(2)] == [
        [0], [1, 2], [3], [4, 5]]
    assert layer_owners(6, 2, 2, layout_counts=counts) == [(0, 0), (1, 0), (1, 0), (0, 1), (1, 1), (1, 1)]
    with pytest.raises(ValueError, match="--pipeline-model-parallel-layout: 4 stages with 6 layers"):
        stage_layers(7, 2, 0, 0, 2, layout_counts=counts)
    with pytest.raises(ValueError, match="contradict"):
        stage_layers(6, 2, 0, 0, 2, first_stage_layers=2, layout_counts=counts)
