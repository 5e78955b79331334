"""--rerun-mode: a non-finite loss is re-run on the same data with the same random state;
reproduced it stops the run (persistent), not reproduced it is reported (transient);
report_stats re-runs every step. Unit tests of RerunState and two driver runs of a model that
diverges (--lr 1e4 without clipping: the loss is NaN from iteration 4 on)."""

import math

import pytest
import torch

from megalite.training.metrics import read_metrics
from megalite.training.rerun import RerunFault, RerunState
from megalite.parallel.random import seed_everything
from tests.training.launch import BASE, drop_flags, launch, run


def _state(mode):
    said = []
    return RerunState(mode, None, torch.device("cpu"), lambda values: values, said.append), said


def test_validate_results_tells_transient_from_persistent():
    state, said = _state("validate_results")
    assert state.check(3, 2.5, lambda: pytest.fail("a finite loss is not re-run")) is None
    assert state.check(4, math.nan, lambda: (2.25,)) == (2.25,)
    assert said == ["--rerun-mode validate_results: iteration 4: the loss was not finite and the re-run on the "
                    "same data gave a finite loss: a transient fault; going on with the re-run"]
    with pytest.raises(RerunFault, match="iteration 5: .* reproduced it: a persistent fault"):
        state.check(5, math.inf, lambda: (math.nan,))


def test_report_stats_reruns_every_step():
    state, _ = _state("report_stats")
    assert state.check(1, 2.0, lambda: (2.0,)) == (2.0,)
    assert state.check(2, 2.0, lambda: (2.5,)) == (2.5,)
    assert state.report() == ("--rerun-mode report_stats: 2 steps re-run, 1 gave a different loss, "
                              "largest difference 5.000e-01")
    assert state.report() is None
    disabled, _ = _state("disabled")
    assert not disabled.active and disabled.check(1, math.nan, lambda: pytest.fail("disabled re-runs")) is None


def test_rng_state_is_restored_for_the_rerun():
    tracker = seed_everything(5)
    state = RerunState("validate_results", tracker, torch.device("cpu"), lambda v: v, print)
    saved = state.save_rng()
    first = (torch.rand(3), tracker.get_states())
    with tracker.fork():
        torch.rand(2)
    state.restore_rng(saved)
    assert torch.equal(torch.rand(3), first[0])
    assert all(torch.equal(a, b) for a, b in zip(tracker.get_states().values(), first[1].values()))


DIVERGING = ["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "211", "--num-layers", "2",
             "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--micro-batch-size", "2",
             "--lr", "1e4", "--clip-grad", "0", "--log-interval", "1", "--num-workers", "0",
             "--distributed-backend", "gloo", "--train-iters", "6", "--eval-iters", "0"]


def test_persistent_nan_stops_the_run_and_disabled_counts_it(tmp_path):
    ranks = launch(DIVERGING, 1, tmp_path / "default")          # validate_results is the default
    assert ranks.wait() == [1]
    log = ranks.logs[0].read_text()
    assert "pretrain_gpt: error: --rerun-mode validate_results: iteration " in log
    assert "a persistent fault (the data or the model), stopping" in log
    run(DIVERGING + ["--rerun-mode", "disabled", "--metrics-file", str(tmp_path / "m.jsonl")], 1,
        tmp_path / "disabled")
    records = read_metrics(str(tmp_path / "m.jsonl"))[0]
    assert sorted(records) == list(range(1, 7)) and sum(r["nan_iterations"] for r in records.values()) >= 1
    stopped_at = int(log.split("validate_results: iteration ")[1].split(":")[0])
    assert not math.isfinite(records[stopped_at]["lm_loss"])
    assert all(math.isfinite(records[i]["lm_loss"]) for i in range(1, stopped_at))


@pytest.mark.slow
def test_report_stats_run_reports_identical_reruns(tmp_path):
    """Dropout on: the re-run gives the same loss only because the random state is restored."""
    ranks = run(drop_flags(BASE, "--train-iters") + ["--train-iters", "3", "--eval-iters", "0", "--rerun-mode",
                                                     "report_stats", "--hidden-dropout", "0.1"], 1, tmp_path)
    log = ranks.logs[0].read_text()
    assert log.count("--rerun-mode report_stats: 1 steps re-run, 0 gave a different loss, "
                     "largest difference 0.000e+00") == 3
