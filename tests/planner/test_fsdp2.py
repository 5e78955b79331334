"""FSDP2 (--use-torch-fsdp2) as a layout the planner searches: its memory against megalite's
dry run of the same flags on three layouts, the Llama-3.1-8B on 8 H100s case that found no
layout before, the layouts enumerated and their flags, the exposed all-gather time, and the one
line naming the nearest preset of a card without one."""

import pytest

from megalite.planner.cli import main
from megalite.planner.cluster import preset
from megalite.planner.layouts import Layout, Space, enumerate_layouts
from megalite.planner.memory import rank_memory
from megalite.planner.search import plan
from megalite.planner.step import _fsdp2_exposed
from megalite.planner.workload import from_flags
from tests.planner.fsdp2_dry_runs import measure
from tests.planner.models import MOE, workload

SMALL = ("--bf16 --tokenizer-type NullTokenizer --vocab-size 32000 --num-layers 4 --hidden-size 256 "
         "--num-attention-heads 4 --group-query-attention --num-query-groups 2 --ffn-hidden-size 704 --swiglu "
         "--normalization RMSNorm --position-embedding-type rope --disable-bias-linear "
         "--untie-embeddings-and-output-weights --attention-dropout 0 --hidden-dropout 0").split()
SEQ = 256
# (layout, global batch): m = 1 without and with full recompute and with TP2 + SP; m = 2
# (the unsharded fp32 gradients accumulated under no_sync)
LAYOUTS = [(Layout(1, 1, 4, micro_batch_size=2, fsdp2=True), 8),
           (Layout(1, 1, 4, micro_batch_size=2, recompute="full", fsdp2=True), 8),
           (Layout(2, 1, 2, micro_batch_size=2, sequence_parallel=True, fsdp2=True), 4),
           (Layout(1, 1, 4, micro_batch_size=1, fsdp2=True), 8)]
LLAMA31_8B = ("--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
              "--num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm "
              "--position-embedding-type rope --rotary-base 500000 --disable-bias-linear "
              "--untie-embeddings-and-output-weights --bf16 --attention-backend flash --tokenizer-type NullTokenizer "
              "--vocab-size 128255 --max-position-embeddings 8192").split()


@pytest.fixture(scope="module")
def measured():
    """The dry run of every layout's launch flags, in one process."""
    return measure([(SMALL, layout, batch) for layout, batch in LAYOUTS], SEQ)


@pytest.mark.parametrize("index", range(len(LAYOUTS)))
def test_fsdp2_memory_within_5_percent_of_the_dry_run(measured, index):
    layout, batch = LAYOUTS[index]
    predicted = rank_memory(from_flags(SMALL, SEQ, batch), layout, 0).total
    assert predicted == pytest.approx(measured[index]["peak_total"], rel=0.05), (layout.short(), measured[index])


def test_fsdp2_dry_run_holds_adams_moments_and_no_shape_propagation(measured):
    """A steady iteration: Adam's moments (8 bytes per parameter / d) held through the step, as
    after the optimizer; DTensor's global-shape stand-ins in the step not counted (they were 16
    shards); what is held after the step is ZeRO-3's 4 + 4 + 8 bytes per shard element exactly."""
    for run in measured:
        assert run["resident"] == run["formula"] and run["resident"]["parameters"] > 0
        assert run["peak"]["optimizer"] == pytest.approx(run["resident"]["optimizer"], rel=0.01)
        assert run["resident"]["optimizer"] == pytest.approx(2 * run["resident"]["parameters"], rel=0.01)


def test_llama31_8b_on_8_h100_fits_only_with_fsdp2():
    """torchtitan trains it with FSDP at s 8192, local batch 2 on 8 H100s; without FSDP2 no layout
    at TP 1 PP 1 fits the planner's 72 GiB."""
    work = from_flags(LLAMA31_8B, 8192, 16)
    space = dict(tp=[1], pp=[1], micro_batch_size=[2])
    result = plan(work, preset("h100", 8), Space(**space))
    assert result.ranked and all(p.layout.fsdp2 for p in result.ranked)
    assert result.ranked[0].memory.total < result.memory_limit
    assert plan(work, preset("h100", 8), Space(**space, fsdp2=[False])).ranked == []


def test_fsdp2_layouts_enumerated_with_their_flags():
    layouts = list(enumerate_layouts(workload(seq=128, batch=16), 8, Space()))
    fsdp = [lay for lay in layouts if lay.fsdp2]
    assert fsdp and all(lay.pp == 1 and not lay.distributed_optimizer and lay.dp > 1 for lay in fsdp)
    flags = fsdp[0].flags()
    assert "--use-torch-fsdp2" in flags and "--overlap-grad-reduce" not in flags and "FSDP2" in fsdp[0].short()
    assert not [lay for lay in enumerate_layouts(workload(MOE, 128, 16), 8, Space()) if lay.fsdp2]
    assert not [lay for lay in enumerate_layouts(workload(seq=128, batch=16), 8, Space(fsdp2=[False])) if lay.fsdp2]
    assert all(lay.fsdp2 for lay in enumerate_layouts(workload(seq=128, batch=16), 8, Space(fsdp2=[True])))


def test_fsdp2_exposed_communication():
    """Gathers hidden behind a longer compute leave the first layer's gather and the last
    layer's reduce-scatter; a shorter compute exposes the difference."""
    work = workload(seq=128, batch=16)
    layout = Layout(1, 1, 8, micro_batch_size=1, fsdp2=True)
    hidden = _fsdp2_exposed(work, layout, reduce=1.0, gather=1.0, forward=10.0, backward=10.0, m=2)
    assert 0 < hidden < 1.0
    exposed = _fsdp2_exposed(work, layout, reduce=1.0, gather=1.0, forward=0.5, backward=0.5, m=2)
    assert exposed == pytest.approx(2 * 0.5 + 1 * 0.5 + 1.5)


@pytest.mark.parametrize("card, nearest", [("b200", "h200"), ("NVIDIA H100 PCIe", "h100"), ("h800", "h100"),
                                           ("some-card", None)])
def test_a_card_without_a_preset_gets_one_line(capsys, card, nearest):
    assert main(["--cluster", card, "--", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                 "--seq-length", "32", "--global-batch-size", "8", "--tokenizer-type", "NullTokenizer",
                 "--vocab-size", "1000"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "no preset for this card" in err
    assert (f"the nearest preset is {nearest} " in err) if nearest else "nearest" not in err


def test_an_empty_search_space_is_said(capsys):
    assert main(["--cluster", "h100", "--num-gpus", "4", "--fsdp2", "on", "--pp", "2", "--", "--num-layers", "4",
                 "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--global-batch-size", "8",
                 "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]) == 1
    assert "no layout in the search space" in capsys.readouterr().out
