"""--rerun-mode and --error-injection-rate / --error-injection-type as Megatron's rerun state
machine (megatron/core/rerun_state_machine.py: RerunStateMachine.validate_result,
should_run_forward_backward, should_checkpoint_and_exit; RerunErrorInjector.maybe_inject,
maybe_miscompare): "Result validation enabled" once, no validation in a job's first iteration,
a NaN / Inf or injected result re-run in place; not reproduced: "Possible transient error",
exit 17; reproduced: a checkpoint and exit 16, and the job resumed from it on another device
says "Possible persistent error" or "Correct result (but possible Application error)", exit 17
(on the same device: exit 16 again). Unit tests of RerunState (megatron-core's injector and
comparison as oracles where installed) and driver runs of a model that diverges (--lr 1e4
without clipping: NaN from iteration 4 on) and of injected faults."""

import json
import math
import random
import re

import pytest
import torch

from megalite.training.metrics import read_metrics
from megalite.training.rerun import RerunFault, RerunState
from megalite.training.rerun_injection import ErrorInjector, compare_floats
from megalite.parallel.random import seed_everything
from tests.training.launch import BASE, drop_flags, launch, run


def _state(mode, injector=None, identity=("node", "cpu:0"), check_nan=True):
    said = []
    state = RerunState(mode, None, torch.device("cpu"), lambda values: values, said.append, injector=injector,
                       log=said.append, identity=lambda: identity, check_nan=check_nan)
    return state, said


def _fault(state, iteration, loss, again):
    with pytest.raises(RerunFault) as info:
        state.check(iteration, loss, lambda: (again,))
    return info.value


def test_validate_results_follows_megatrons_state_machine():
    """Megatron: 'Result validation enabled' at the first validation; the first iteration of a
    job is not validated; a NaN re-run in place that stays NaN saves a checkpoint and exits 16;
    one that comes out finite is a possible transient error, exit 17."""
    state, said = _state("validate_results")
    assert state.check(1, math.nan, lambda: pytest.fail("the first iteration is not validated")) is None
    assert state.check(2, 2.5, lambda: pytest.fail("a finite loss is not re-run")) is None
    assert said == ["Result validation enabled"]
    fault = _fault(state, 3, math.nan, math.nan)
    assert (fault.exit_code, fault.save_checkpoint) == (16, True)
    assert said[1:] == [
        "Unexpected result nan on rank 0 at iteration #3 (message='found NaN in local forward loss calculation')",
        "Need to rerun step to check reproducibility of initial result",
        "Rank 0, node node, device cpu:0, iteration #3: First rerun: unexpected result is reproducible within the "
        "tolerance (nan = nan). Need to rerun on a different GPU to verify correctness.!",
        "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last iteration "
        "and establish a diagnostic"]
    state, said = _state("validate_results")
    state.check(1, 2.0, lambda: None)
    fault = _fault(state, 2, math.inf, 2.25)
    assert (fault.exit_code, fault.save_checkpoint) == (17, False)
    assert "found Inf in local forward loss calculation" in said[1]
    assert said[-3:] == [
        "Rank 0, node node, device cpu:0, iteration #2: First rerun: unexpected result is not reproducible within "
        "the tolerance (2.25 != inf)!",
        "Rank 0, node node, device cpu:0, iteration #2: Possible transient error!!",
        "Exiting now. The job can be resumed from a previous checkpoint"]


def test_without_the_nan_check_a_nan_loss_is_not_a_rejected_result():
    """--no-check-for-nan-in-loss-and-grad: Megatron validates no loss for NaN or Inf, so nothing
    is re-run; an injected rejection still is."""
    state, said = _state("validate_results", check_nan=False)
    for iteration, loss in ((1, 1.0), (2, math.nan), (3, math.inf)):
        assert state.check(iteration, loss, lambda: pytest.fail("re-ran an unchecked NaN")) is None
    assert said == ["Result validation enabled"]
    injected, _ = _state("validate_results", ErrorInjector(1, "transient_error", 0, 0), check_nan=False)
    injected.check(1, 1.0, lambda: pytest.fail("the first iteration is not validated"))
    assert _fault(injected, 2, 1.0, 2.0).exit_code == 17


def test_report_stats_and_disabled_say_nothing_of_validation():
    state, said = _state("report_stats")
    assert state.check(1, 2.0, lambda: (2.0,)) == (2.0,)
    assert state.check(2, 2.0, lambda: (2.5,)) == (2.5,)
    assert state.report() == ("--rerun-mode report_stats: 2 steps re-run, 1 gave a different loss, "
                              "largest difference 5.000e-01")
    assert state.report() is None
    disabled, said_disabled = _state("disabled")
    assert not disabled.active and disabled.check(2, math.nan, lambda: pytest.fail("disabled re-runs")) is None
    assert "Result validation enabled" not in said + said_disabled


@pytest.mark.parametrize("kind, first_exit, second, second_exit", [
    ("transient_error", 17, None, None),
    ("persistent_error", 16, "Possible persistent error!", 17),
    ("correct_result", 16, "Correct result (but possible Application error) "
                           "(found NaN in local forward loss calculation)!", 17)])
def test_injected_faults_are_diagnosed_as_megatron_does(kind, first_exit, second, second_exit):
    """--error-injection-rate 1: the second iteration's first validation is rejected; its re-runs
    give the comparison RerunErrorInjector.maybe_miscompare forces for the type."""
    state, said = _state("validate_results", ErrorInjector(1, kind))
    state.check(1, 2.0, lambda: None)
    fault = _fault(state, 2, 2.0, 2.0)
    assert fault.exit_code == first_exit
    assert said[1] == f"Injecting error type {dict(transient_error='Transient error', persistent_error='Persistent error', correct_result='Expected result')[kind]}"
    assert said[2] == ("Unexpected result 2.0 on rank 0 at iteration #2 invocation #1 "
                       "(message='found NaN in local forward loss calculation')")
    if second is None:
        assert said[-2].endswith("Possible transient error!!")
        return
    record = {"ranks": [json.loads(json.dumps(state.checkpoint_state()))]}  # as the checkpoint stores it
    for identity, exit_code, line in ((("node", "cpu:1"), second_exit, second),
                                      (("node", "cpu:0"), 16, "Got rescheduled on the same GPU")):
        resumed, said = _state("validate_results", ErrorInjector(0, "transient_error"), identity)
        resumed.load(record, 1, same_layout=True)
        fault = _fault(resumed, 2, 2.0, 2.0)
        assert fault.exit_code == exit_code and not fault.save_checkpoint
        assert said[0] == "Getting RerunStateMachine state from checkpoint. Will rerun step."
        assert any(line in text for text in said), said


def test_injection_draws_and_comparisons_match_megatron_core():
    """Oracle: megatron-core's RerunErrorInjector (the same draw from Python's random for the
    same seed, the same forced comparisons) and _compare_floats."""
    machine = pytest.importorskip("megatron.core.rerun_state_machine")
    for rate in (1, 3, 100):
        random.seed(5)
        theirs = machine.RerunErrorInjector(rate, machine.RerunDiagnostic.TRANSIENT_ERROR)
        mine = ErrorInjector(rate, "transient_error", seed=5)
        for _ in range(300):
            got, expected = mine.maybe_inject(), theirs.maybe_inject()
            assert got == expected
            mine.injected = theirs.injected_error_type = None
    for kind in ("transient_error", "persistent_error", "correct_result"):
        theirs = machine.RerunErrorInjector(1, machine.RerunDiagnostic(kind))
        mine = ErrorInjector(1, kind)
        assert theirs.maybe_inject() and mine.maybe_inject()
        assert mine.compare(True, 1.0, 1.0) == theirs.maybe_miscompare(
            None, 1.0, 1.0, machine.RerunState.RERUNNING_IN_PLACE)
        if kind != "transient_error":
            assert mine.compare(False, 1.0, 1.0) == theirs.maybe_miscompare(
                None, 1.0, 1.0, machine.RerunState.RERUNNING_FROM_CHECKPOINT)
    for a, b in ((1.0, 1.0), (math.nan, math.nan), (math.nan, 1.0), (math.inf, 1.0), (math.nan, math.inf),
                 (2.0, 2.5), (math.inf, math.inf)):
        assert compare_floats(a, b) == machine._compare_floats(torch.tensor(a), torch.tensor(b))


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


def test_persistent_nan_checkpoints_and_exits_16_and_disabled_stops_or_skips(tmp_path):
    ranks = launch(DIVERGING + ["--save", str(tmp_path / "ckpt")], 1, tmp_path / "default")  # validate_results
    assert ranks.wait() == [16]
    log = ranks.logs[0].read_text()
    assert log.count("Result validation enabled") == 1
    assert "First rerun: unexpected result is reproducible within the tolerance (nan = nan)" in log
    assert "Saving a checkpoint and exiting now." in log
    stopped_at = int(log.split("at iteration #")[1].split(" ")[0])
    common = json.loads((tmp_path / "ckpt" / f"iter_{stopped_at - 1:07d}" / "common.json").read_text())
    assert common["rerun_state_machine"]["iteration"] == stopped_at
    assert common["rerun_state_machine"]["ranks"][0]["failed"]["message"] == \
        "found NaN in local forward loss calculation"
    # disabled: nothing is re-run, but --check-for-nan-in-loss-and-grad (Megatron's default) stops
    # the run at the step, its update not applied (before, the NaN update was applied and the run went on)
    ranks = launch(DIVERGING + ["--rerun-mode", "disabled"], 1, tmp_path / "disabled", separate_stderr=True)
    assert ranks.wait() == [17]
    assert "Result validation enabled" not in ranks.logs[0].read_text()
    [line] = ranks.stderr(0).strip().splitlines()[-1:]
    assert line.startswith(f"pretrain_gpt: error: iteration {stopped_at}: the gradients hold NaN or Inf (norm nan, "
                           "loss nan); the step was not applied."), line
    assert line.endswith("--no-check-for-nan-in-loss-and-grad skips such steps instead")
    # --no-check-for-nan-in-loss-and-grad: no rejected result even in validate_results, the step is skipped
    run(DIVERGING + ["--no-check-for-nan-in-loss-and-grad", "--metrics-file", str(tmp_path / "m.jsonl")], 1,
        tmp_path / "unchecked")
    records = read_metrics(str(tmp_path / "m.jsonl"))[0]
    assert sorted(records) == list(range(1, 7)) and sum(r["nan_iterations"] for r in records.values()) >= 1
    assert records[stopped_at]["skipped_iterations"] == 1 and not math.isfinite(records[stopped_at]["lm_loss"])
    assert all(math.isfinite(records[i]["lm_loss"]) for i in range(1, stopped_at))


def test_a_static_loss_scale_stops_on_nan_gradients_as_megatron(tmp_path):
    """--fp16 --loss-scale: Megatron keeps --check-for-nan-in-loss-and-grad on (only a dynamic
    scale turns it off), so the diverging run stops with 17 at the first NaN / Inf gradient
    instead of skipping the step as an overflow (megalite did: the fp16 skip returns no norm)."""
    fp16 = DIVERGING + ["--fp16", "--rerun-mode", "disabled", "--metrics-file", str(tmp_path / "m.jsonl")]
    ranks = launch(fp16 + ["--loss-scale", "1"], 1, tmp_path / "static", separate_stderr=True)
    assert ranks.wait() == [17], ranks.output()
    [line] = ranks.stderr(0).strip().splitlines()[-1:]
    assert re.fullmatch(r"pretrain_gpt: error: iteration \d+: the gradients hold NaN or Inf \(found by the fp16 "
                        r"unscale, static --loss-scale, loss \S+\); the step was not applied\..*", line), line
    stopped_at = int(line.split()[3].rstrip(":"))
    assert sorted(read_metrics(str(tmp_path / "m.jsonl"))[0]) == list(range(1, stopped_at))
    # a dynamic scale skips the overflowing steps and trains on
    run(drop_flags(fp16, "--metrics-file") + ["--initial-loss-scale", "1", "--metrics-file",
                                              str(tmp_path / "dynamic.jsonl")], 1, tmp_path / "dynamic")
    records = read_metrics(str(tmp_path / "dynamic.jsonl"))[0]
    assert sorted(records) == list(range(1, 7)) and sum(r["skipped_iterations"] for r in records.values()) >= 1


INJECTED = drop_flags(BASE, "--train-iters") + ["--train-iters", "4", "--eval-iters", "0",
                                                "--error-injection-rate", "1"]


def test_injected_transient_error_stops_with_17(tmp_path):
    """gpt3_mcore_reruns_transient's flags at toy scale: the log lines its check_log looks for."""
    ranks = launch(INJECTED + ["--error-injection-type", "transient_error", "--metrics-file",
                               str(tmp_path / "m.jsonl")], 2, tmp_path / "logs")
    assert ranks.wait() == [17, 17], ranks.output()
    log = ranks.logs[0].read_text()
    for line in ("Result validation enabled", "Injecting error type Transient error", "Possible transient error!!",
                 "Exiting now. The job can be resumed from a previous checkpoint"):
        assert line in log, line
    assert sorted(read_metrics(str(tmp_path / "m.jsonl"))[0]) == [1]  # iteration 2 never completed


@pytest.mark.slow
def test_injected_persistent_error_is_diagnosed_from_its_checkpoint(tmp_path):
    """gpt3_mcore_reruns_persistent_1's lines, then the job resumed on another device (another
    LOCAL_RANK on CPU) diagnoses it; resumed on the same one it asks to be resumed elsewhere."""
    argv = INJECTED + ["--error-injection-type", "persistent_error", "--save", str(tmp_path / "ckpt"),
                       "--load", str(tmp_path / "ckpt")]
    ranks = launch(argv, 1, tmp_path / "first")
    assert ranks.wait() == [16]
    log = ranks.logs[0].read_text()
    assert "First rerun: unexpected result is reproducible within the tolerance" in log
    assert ("Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the last "
            "iteration and establish a diagnostic") in log
    ranks = launch(argv, 1, tmp_path / "elsewhere", env={"LOCAL_RANK": "3"})
    assert ranks.wait() == [17]
    assert "Possible persistent error!!" in ranks.logs[0].read_text()
    ranks = launch(argv, 1, tmp_path / "same")
    assert ranks.wait() == [16]
    assert "Got rescheduled on the same GPU" in ranks.logs[0].read_text()
