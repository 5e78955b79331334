"""Activation memory of a Gated DeltaNet hybrid (Qwen3-Next's pattern: three linear layers, then
full attention) in the dry run and the planner: the dry run's most activations held within 10%
of the formula (megalite/dryrun/README.md, "Activation memory of Gated DeltaNet layers"), each
layer costed by its kind, at TP2 with SP and at PP2 (stage 0 holding only linear layers, two
micro-batches in flight under 1F1B); the planner's peak within 5% of the dry run's there and
under full recompute (where the recomputed layer is a linear one)."""

import pytest

from megalite.planner.layouts import Layout
from megalite.planner.memory import rank_memory
from megalite.planner.workload import from_flags
from tests.planner.fsdp2_dry_runs import measure

HYBRID = ("--bf16 --tokenizer-type NullTokenizer --vocab-size 1000 --num-layers 4 --hidden-size 256 "
          "--num-attention-heads 4 --ffn-hidden-size 1024 --swiglu --normalization RMSNorm "
          "--position-embedding-type rope --disable-bias-linear --untie-embeddings-and-output-weights "
          "--attention-dropout 0 --hidden-dropout 0 --experimental-attention-variant gdn --linear-attention-freq 4 "
          "--linear-key-head-dim 32 --linear-value-head-dim 32 --linear-num-key-heads 4 "
          "--linear-num-value-heads 8").split()
SEQ = 256
# (layout, global batch)
RUNS = {"tp2-sp": (Layout(2, 1, 1, micro_batch_size=2, sequence_parallel=True), 2),
        "pp2-1f1b": (Layout(1, 2, 1, micro_batch_size=2, schedule="1f1b"), 4),
        "tp2-sp-full-recompute": (Layout(2, 1, 1, micro_batch_size=2, sequence_parallel=True, recompute="full"), 2)}


@pytest.fixture(scope="module")
def measured():
    """The first stage's dry run of each layout, in one process (fake CUDA: flash attention)."""
    return dict(zip(RUNS, measure([(HYBRID, layout, batch) for layout, batch in RUNS.values()], SEQ)))


@pytest.mark.parametrize("name", ["tp2-sp", "pp2-1f1b"])
def test_dry_run_activations_within_10_percent_of_the_formula(measured, name):
    report = measured[name]
    ratio = report["activation_peak"] / report["korthikanti"]
    assert 0.9 <= ratio <= 1.1, (name, ratio, report["activation_peak"], report["korthikanti"])


@pytest.mark.parametrize("name", list(RUNS))
def test_planner_memory_within_5_percent_of_the_dry_run(measured, name):
    layout, batch = RUNS[name]
    predicted = rank_memory(from_flags(HYBRID, SEQ, batch), layout, 0)
    assert predicted.total == pytest.approx(measured[name]["peak_total"], rel=0.05), (name, predicted,
                                                                                       measured[name]["peak"])
