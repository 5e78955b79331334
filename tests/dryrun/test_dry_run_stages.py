"""The default dry run measures one rank of every distinct pipeline stage, prints a row per
stage and a verdict naming the highest peak's stage and whether it fits the GPU's memory.

The toy layout is built so that a middle stage peaks highest: the embedding and the loss each
count as a layer (--account-for-embedding/loss-in-pipeline-split), so of the 12 virtual stages
rank 0's first chunk holds the embedding alone and rank 5's second the loss alone, every other chunk
one layer: ranks 0 and 5 hold one layer, the middle ranks two; under interleaved 1F1B ranks 1 and 2
keep every chunk-micro-batch in flight (warm-up capped at m*v), ranks 3 and 4 fewer. (Ten layers,
not the 20 that --decoder-first/last-pipeline-num-layers 2 would need for the same shape: the dry
run's time is its ops, ~1 ms each through FakeTensor and MemTracker, and ops scale with the layers;
the first/last flags' distinct stages: test_llama3_405b_has_ten_distinct_stages.)"""

import json
import re
import sys
from types import SimpleNamespace

import pytest

from megalite.dryrun.report import verdict
from megalite.dryrun.stages import distinct_stages, stage_label
from megalite.config.arguments import layout_from_args, model_config_from_args, parse_args, validate_args
from tests import program_server
from tests.dryrun.test_fake_cuda import REPO, fake_cuda_env

TOY = ("--mock-data --tokenizer-type NullTokenizer --vocab-size 211 --hidden-size 64 --num-attention-heads 4 "
       "--seq-length 32 --micro-batch-size 1 --lr 1e-3 --train-iters 1 --bf16 --dry-run").split()
MIDDLE_HIGHEST = TOY + ("--num-layers 10 --global-batch-size 6 --pipeline-model-parallel-size 6 "
                        "--num-virtual-stages-per-pipeline-rank 2 --account-for-embedding-in-pipeline-split "
                        "--account-for-loss-in-pipeline-split --dry-run-world-size 6").split()
LLAMA3_405B = ("--dry-run --dry-run-world-size 1024 --tensor-model-parallel-size 8 --pipeline-model-parallel-size 16 "
               "--num-virtual-stages-per-pipeline-rank 2 --decoder-first-pipeline-num-layers 6 "
               "--decoder-last-pipeline-num-layers 8 --sequence-parallel --use-distributed-optimizer --bf16 --mock-data "
               "--tokenizer-type NullTokenizer --vocab-size 128256 --num-layers 126 --hidden-size 16384 "
               "--num-attention-heads 128 --group-query-attention --num-query-groups 8 --ffn-hidden-size 53248 --swiglu "
               "--normalization RMSNorm --position-embedding-type rope --rotary-base 500000 --disable-bias-linear "
               "--untie-embeddings-and-output-weights --seq-length 8192 --micro-batch-size 1 --global-batch-size 128 "
               "--lr 3e-4 --train-iters 1 --attention-dropout 0 --hidden-dropout 0").split()
ROW = re.compile(r"^\s+([\d, -]+?)\s+(\d+)\s+([\d+]+)((?:\s+[\d.]+){6})\s+(yes|NO)$", re.M)


def _groups(argv, device="cuda"):
    args = parse_args(argv)
    world = args.dry_run_world_size or args.pipeline_model_parallel_size * args.tensor_model_parallel_size
    validate_args(args, world)
    layout = layout_from_args(args, world)
    return [stage_label(g) for g in distinct_stages(args, model_config_from_args(args, args.vocab_size), layout,
                                                     device)]


def _dry_run(argv):
    return program_server.run([sys.executable, "-m", "megalite.pretrain_gpt", *argv], env=fake_cuda_env(),
                              capture_output=True, text=True, timeout=600, cwd=REPO)


def test_stage_labels():
    assert [stage_label(g) for g in ([3], [1, 2, 3, 4], [1, 2, 3, 5], [0, 2, 4])] == ["3", "1-4", "1-3, 5", "0, 2, 4"]


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_llama3_405b_has_ten_distinct_stages(device):
    # p 16, v 2, m 16: interleaved warm-up min(2 (15 - r) + 16, 32) keeps all 32 chunk-micro-batches
    # in flight on ranks 0-7; rank 0 holds 3 layers per chunk, 1-14 four, 15 four with the output
    # layer. Ranks 1-7 are alike; 8-14 each keep two fewer in flight than the one before.
    assert _groups(LLAMA3_405B, device) == ["0", "1-7", *map(str, range(8, 16))]


def test_no_pipeline_is_one_stage_and_layer_counts_alone_do_not_make_stages_alike():
    assert _groups(TOY + "--num-layers 4 --global-batch-size 2".split()) == ["0"]
    pp4 = TOY + "--num-layers 8 --global-batch-size 8 --pipeline-model-parallel-size 4".split()
    assert _groups(pp4) == ["0", "1", "2", "3"]  # 1F1B: p - r - 1 warm-up forwards on rank r
    assert _groups(pp4 + ["--pipeline-schedule", "gpipe"]) == ["0", "1-2", "3"]


def _report(rank, total):
    return SimpleNamespace(rank=rank, peak_total=int(total * 2 ** 30))


@pytest.mark.parametrize("gib, outcome, margin", [
    (100, "FITS", " a GPU of 100 GiB (--dry-run-gpu-memory-gib): 12.50 GiB to spare under the 90.00 GiB (90%) that "
     "tensors may fill; the other 10%"),
    (85, "TIGHT", ": 7.50 GiB under a GPU of 85 GiB (--dry-run-gpu-memory-gib) but 1.00 GiB over the 76.50 GiB (90%) "
     "that tensors may fill, on stages 1-3 (3 of 5); the other 10%"),
    (70, "DOES NOT FIT", " a GPU of 70 GiB (--dry-run-gpu-memory-gib): 7.50 GiB over, on stages 1-3 (3 of 5)")])
def test_verdict_names_the_highest_stage_and_the_fit(gib, outcome, margin):
    stages, reports = [[0], [1, 2, 3], [4]], [_report(0, 60), _report(8, 77.5), _report(32, 50)]
    line = verdict(stages, reports, gib)
    assert line.startswith("verdict: highest peak 77.50 GiB (79,360 MiB) on pipeline stages 1-3 (rank 8 measured): "
                           + outcome + margin), line


def test_verdict_lists_every_stage_over_the_limit_and_none_without_pipelining():
    stages, reports = [[0], [1, 2], [3], [4]], [_report(0, 81), _report(8, 90), _report(24, 79), _report(32, 85)]
    assert verdict(stages, reports, 80).endswith(": DOES NOT FIT a GPU of 80 GiB (--dry-run-gpu-memory-gib): "
                                                 "10.00 GiB over, on stages 0-2, 4 (4 of 5)")
    assert verdict([[0]], [_report(0, 81)], 80) == ("verdict: highest peak 81.00 GiB (82,944 MiB) on rank 0: DOES NOT "
                                                   "FIT a GPU of 80 GiB (--dry-run-gpu-memory-gib): 1.00 GiB over")


def test_dry_run_reports_every_distinct_stage_and_the_highest_that_does_not_fit():
    # 0.002 GiB = 2.05 MiB: under the middle stages' peaks (2.4-2.6 MiB), over the first's and last's (1.7)
    out = _dry_run(MIDDLE_HIGHEST + ["--dry-run-gpu-memory-gib", "0.002"])
    assert out.returncode == 0, out.stderr[-3000:]  # measured: 0 even when the layout does not fit
    rows = {m[0]: (int(m[1]), m[2], [float(x) for x in m[3].split()], m[4]) for m in ROW.findall(out.stdout)}
    assert list(rows) == ["0", "1-2", "3", "4", "5"], out.stdout  # every stage, ranks 1 and 2 once
    assert [r[0] for r in rows.values()] == [0, 1, 3, 4, 5] and all(r[3] == "yes" for r in rows.values())
    assert [r[1] for r in rows.values()] == ["0+1", "1+1", "1+1", "1+1", "1+0"]
    totals = {stage: r[2][5] for stage, r in rows.items()}
    assert all(abs(sum(r[2][:5]) - r[2][5]) < 0.01 for r in rows.values())
    highest = max(totals, key=totals.get)
    assert highest == "1-2" and totals["1-2"] > totals["0"] * 1.5, totals  # constructed so
    assert totals["3"] > totals["4"]  # same layers, fewer micro-batches in flight
    last = out.stdout.strip().splitlines()[-1]
    assert re.match(rf"verdict: highest peak [\d.]+ GiB \({totals['1-2']:,.0f} MiB\) on pipeline stages 1-2 "
                    r"\(rank 1 measured\): DOES NOT FIT a GPU of 0.002 GiB \(--dry-run-gpu-memory-gib\): [\d.]+ GiB "
                    r"over, on stages 1-4 \(4 of 6\)$", last), last
    assert "measuring 5 of 6 pipeline stages" in out.stderr


@pytest.mark.slow
def test_members_of_a_distinct_stage_measure_the_same():
    """The grouping's claim checked: with every stage measured (--dry-run-all-stages), the
    stages of one group hold the same bytes at the peak, at most at once and after the step,
    and send the same."""
    out = program_server.run([sys.executable, "-m", "tests.dryrun.dry_run_json", *MIDDLE_HIGHEST,
                              "--dry-run-all-stages"], env=fake_cuda_env(), capture_output=True, text=True,
                             timeout=600, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout)
    assert [r["coords"][2] for r in got] == list(range(6))
    measured = [(r["peak"], r["activation_peak"], r["resident"], r["comm"]) for r in got]
    groups = _groups(MIDDLE_HIGHEST)
    assert groups == ["0", "1-2", "3", "4", "5"]
    assert measured[1] == measured[2]
    assert len({json.dumps(m, sort_keys=True) for m in measured}) == 5  # the other stages differ


@pytest.mark.slow
def test_dry_run_splits_layers_as_the_pipeline_split_accounting_flags_say():
    """Megatron's --account-for-embedding/loss-in-pipeline-split with virtual stages (6 layers
    over PP=4 x VP=2, the embedding and the loss each counted as a layer: Megatron-LM's
    layers_per_virtual_stage gives the first and last virtual stage no transformer layer). The
    dry run builds and reports the layout the run would train, stage by stage. Slow: the default
    suite's test_dry_run_reports_every_distinct_stage_... dry-runs the same flags (PP=6 x VP=2) and
    checks the same 0+1 ... 1+0 rows, in the same dry run it needs anyway."""
    argv = TOY + ("--num-layers 6 --global-batch-size 4 --pipeline-model-parallel-size 4 "
                  "--num-virtual-stages-per-pipeline-rank 2 --account-for-embedding-in-pipeline-split "
                  "--account-for-loss-in-pipeline-split --dry-run-world-size 4").split()
    out = _dry_run(argv)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = {m[0]: m[2] for m in ROW.findall(out.stdout)}
    # 8 virtual stages hold [E], 1, 1, 1 | 1, 1, 1, [L]: chunk 0 of rank 0 and chunk 1 of rank 3 hold none
    assert rows == {"0": "0+1", "1": "1+1", "2": "1+1", "3": "1+0"}, out.stdout


def test_distinct_stages_follow_the_pipeline_layout_string():
    """--pipeline-model-parallel-layout sets each stage's layers: under GPipe the middle ranks are one
    distinct stage only where the layout gives them the same layers (the even split would join them)."""
    pp4 = TOY + "--num-layers 8 --global-batch-size 8 --pipeline-model-parallel-size 4 --pipeline-schedule gpipe".split()
    assert _groups(pp4 + ["--pipeline-model-parallel-layout", "Et|ttt|t|tttL"]) == ["0", "1", "2", "3"]
    assert _groups(pp4 + ["--pipeline-model-parallel-layout", "Et*3|tt|tt|tL"]) == ["0", "1-2", "3"]
