"""tools/plan.py --verify: the dry run checks the finalists; one measured over the memory limit
is dropped for the next layout in the ranking, and the launch lines printed are the confirmed
ones. End to end on fake CUDA, the measured peaks sit beside the planner's predictions."""

import re

from megalite.planner import verify as verify_module
from megalite.planner.cli import main
from megalite.planner.cluster import preset
from megalite.planner.layouts import Space
from megalite.planner.search import plan
from megalite.planner.verify import verify
from megalite.planner.workload import from_flags
from tests.planner.test_cli import MODEL
from tests.training.launch import drop_flags


def small_plan():
    return plan(from_flags(MODEL[1:]), preset("h100", 8), Space(), simulate=8)


def test_a_finalist_measured_over_the_limit_is_replaced_by_the_next_layout():
    result = small_plan()
    measured = []

    def measure(flags):  # the first layout is measured over the limit, every other one fits
        measured.append(flags)
        peak = 1.5 * result.memory_limit if len(measured) == 1 else 1.0
        return [{"rank": 0, "pp_rank": 0, "peak": {"activations": peak}, "peak_total": peak}]

    confirmed, report = verify(result, 2, measure)
    assert confirmed == result.ranked[1:3] and len(measured) == 3
    assert measured[0][measured[0].index("--tensor-model-parallel-size") + 1] == str(result.ranked[0].layout.tp)
    assert f"{result.ranked[0].layout.short():34} dropped: measured peak" in report


def test_a_failed_dry_run_drops_the_layout_and_too_few_confirmed_is_said():
    result = small_plan()

    def measure(flags):
        raise RuntimeError("dry run failed: MixedTensorsError")

    confirmed, report = verify(result, 3, measure)
    assert confirmed == [] and report.count("dropped: dry run failed") == len(result.ranked)
    assert f"0 of the {len(result.ranked)} simulated layouts confirmed" in report


def test_cli_prints_only_confirmed_launch_lines(monkeypatch, capsys):
    calls = []

    def measure(flags):
        calls.append(flags)
        peak = 10 * 2**40 if len(calls) == 1 else 2**20  # the first finalist does not fit
        return [{"rank": 0, "pp_rank": 0, "peak": {"activations": peak}, "peak_total": peak}]

    monkeypatch.setattr(verify_module, "measure", measure)
    assert main(["--cluster", "h100", "--num-gpus", "8", "--verify", "--finalists", "2"] + MODEL) == 0
    out = capsys.readouterr().out
    numbers = [int(n) for n in re.findall(r"^#(\d+) ", out, re.M)]
    assert numbers == [2, 3] and out.count("bash scripts/pretrain_gpt.sh") == 2


# MODEL's global batch 32 gives each DP2 rank 16 micro-batches to dry-run on fake CUDA; 4 gives 2, as many
# as PP2's 1F1B holds in flight at once: both stages still measured, in an eighth of the steps
FOUR_SEQUENCES = drop_flags(MODEL, "--global-batch-size") + ["--global-batch-size", "4"]


def test_verify_end_to_end_on_fake_cuda(capsys):
    assert main(["--cluster", "h100", "--num-gpus", "8", "--tp", "2", "--pp", "2", "--vp", "1",
                 "--micro-batch-size", "1", "--recompute", "none", "--sequence-parallel", "on",
                 "--distributed-optimizer", "on", "--verify", "--finalists", "1"] + FOUR_SEQUENCES) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.startswith("TP2 PP2 DP2 mb1 SP DO ")]
    assert {row[6] for row in rows} == {"0", "1"}, out  # both pipeline stages measured
    for row in rows:
        measured, predicted = float(row[7]), float(row[8])
        assert 0 < measured and 0 < predicted
    assert out.count("bash scripts/pretrain_gpt.sh") == 1 and "dropped" not in out
