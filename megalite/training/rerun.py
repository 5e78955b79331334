"""--rerun-mode: re-run a training step's forward and backward on the same micro-batches with
the same random state, as Megatron's rerun state machine does (megatron/core/
rerun_state_machine.py), to tell a transient fault from a persistent one or a correct result.

    validate_results  "Result validation enabled" is said once. From the second iteration of a
                      job on, a step whose loss is NaN or infinite (or one --error-injection-*
                      rejects) is re-run in place:
                        not reproduced: "Possible transient error", the job stops, exit 17
                          (resume from an earlier checkpoint);
                        reproduced: a checkpoint of the state before the step is saved with the
                          fault's record and the job stops, exit 16. Resumed from it on another
                          node or device, the step runs once more: a different result is a
                          "Possible persistent error", the same one a "Correct result (but
                          possible Application error)", exit 17 either way; resumed on the same
                          device, exit 16 again (Megatron's "rescheduled on the same GPU").
    report_stats      every step is run twice; every --log-interval one line reports how many
                      re-runs gave a different loss and the largest difference.
    disabled          nothing is re-run; a step with NaN or Inf gradients still stops the run
                      (exit 17) unless --no-check-for-nan-in-loss-and-grad, which skips it.

The step's micro-batches are kept (a list of this step's batches, only on ranks that read data)
and the RNG states (torch's CPU and CUDA generators and the model-parallel tracker) are saved
before the first run and restored before the re-run and before the checkpoint.
"""

import math

import torch

from megalite.training.rerun_injection import ERROR_NAMES, INF_MESSAGE, NAN_MESSAGE, ErrorInjector, device_identity

EXIT_CODE_RESUME_TO_DISAMBIGUATE = 16  # Megatron's exit codes
EXIT_CODE_FAILED_ON_RESULT_VALIDATION = 17
WILL_RERUN_FROM_CHECKPOINT = "will_rerun_from_checkpoint"


class RerunFault(RuntimeError):
    """The run stops on a result validation; `exit_code` as Megatron's, `save_checkpoint`: the
    state before the step is to be saved first."""

    def __init__(self, message: str, exit_code: int = EXIT_CODE_FAILED_ON_RESULT_VALIDATION,
                 save_checkpoint: bool = False):
        super().__init__(message)
        self.exit_code, self.save_checkpoint = exit_code, save_checkpoint


def non_finite_gradients(iteration: int, grad_norm: float | None, loss) -> RerunFault:
    """--check-for-nan-in-loss-and-grad: the step whose gradients hold NaN or Inf (the optimizer
    did not apply it) stops the run, as Megatron's check of every gradient bucket does; under a
    static --loss-scale too, where the fp16 unscale found them (`grad_norm` None), since Megatron
    keeps the check on unless the loss scale is dynamic."""
    found = f"norm {grad_norm}" if grad_norm is not None else "found by the fp16 unscale, static --loss-scale"
    return RerunFault(f"iteration {iteration}: the gradients hold NaN or Inf ({found}"
                      + ("" if loss is None else f", loss {loss}") + "); the step was not applied. Megatron stops "
                      "here too (--check-for-nan-in-loss-and-grad, on by default); --no-check-for-nan-in-loss-and-grad "
                      "skips such steps instead")


def finite(loss) -> bool:
    return loss is None or math.isfinite(loss)


class RerunState:
    def __init__(self, mode: str, tracker, device, agree, say, *, rank: int = 0, injector: ErrorInjector | None = None,
                 log=print, identity=None, check_nan: bool = True):
        """`agree(values) -> values`: the element-wise maximum over all ranks; `say`: rank 0's
        print; `log`: this rank's print; `identity()`: the (node, device) this rank runs on;
        `check_nan`: a NaN or Inf loss is a rejected result (--check-for-nan-in-loss-and-grad)."""
        self.mode, self.tracker, self.device, self.agree, self.say = mode, tracker, device, agree, say
        self.check_nan = check_nan
        self.rank, self.log = rank, log
        self.injector = injector or ErrorInjector(rank=rank)
        self.identity = identity or (lambda: device_identity(torch.device(device)))
        self.reruns = self.differed = 0
        self.largest_difference = 0.0
        self.announced = self.first_iteration_complete = False
        self.failed = None  # this rank's rejected result: {"message", "initial", "suspicious"}
        self.pending = False  # resumed from the checkpoint of a reproduced fault

    @property
    def active(self) -> bool:
        return self.mode != "disabled"

    def save_rng(self) -> dict:
        state = {"cpu": torch.get_rng_state(), "injector": self.injector.random.getstate()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        if self.tracker is not None:
            state["tracker"] = {k: v.clone() for k, v in self.tracker.get_states().items()}
        return state

    def restore_rng(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        self.injector.random.setstate(state["injector"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)
        if "tracker" in state:
            self.tracker.set_states(state["tracker"])

    # --- validate_results ---------------------------------------------------------------------
    def _failure(self, iteration: int, text: str) -> None:
        node, device = self.identity()
        self.log(f"Rank {self.rank}, node {node}, device {device}, iteration #{iteration}: {text}!")

    def _validate(self, iteration: int, loss, num_validations: int) -> None:
        """This rank's validations of the step's loss (Megatron validates each micro-batch's loss
        twice, for NaN and for Inf); records the first rejected one in self.failed."""
        if loss is None or not self.first_iteration_complete:
            return
        for call in range(num_validations):
            message = NAN_MESSAGE if call % 2 == 0 else INF_MESSAGE
            injected = self.injector.maybe_inject()
            if injected:
                self.log(f"Injecting error type {ERROR_NAMES[self.injector.kind]}")
            if injected or self.check_nan and (math.isnan(loss) if call % 2 == 0 else math.isinf(loss)):
                where = f" invocation #{call // 2 + 1}" if injected else ""
                self.log(f"Unexpected result {loss} on rank {self.rank} at iteration #{iteration}{where} "
                         f"(message='{message}')")
                self.failed = {"message": message, "initial": loss, "suspicious": None}
                return

    def _first_rerun(self, iteration: int, result) -> bool:
        """Whether this rank asks for the checkpoint (the fault was reproduced)."""
        if self.failed is None:
            return False
        initial = self.failed["initial"]
        if self.injector.compare(True, initial, result) > 0.0:
            self._failure(iteration, f"First rerun: unexpected result is not reproducible within the tolerance "
                                     f"({result} != {initial})")
            self._failure(iteration, "Possible transient error!")
            return False
        self.failed["suspicious"] = list(self.identity())
        self._failure(iteration, f"First rerun: unexpected result is reproducible within the tolerance "
                                 f"({result} = {initial}). Need to rerun on a different GPU to verify correctness.")
        return True

    def _rerun_from_checkpoint(self, iteration: int, result) -> None:
        """The step re-run by the job resumed from the fault's checkpoint: the diagnosis."""
        restart = False
        if self.failed is not None:
            initial, suspicious = self.failed["initial"], self.failed["suspicious"]
            if suspicious is not None and list(self.identity()) == suspicious:
                self.log(f"Got rescheduled on the same GPU. Need to resume again from the same checkpoint "
                         f"(node: {suspicious[0]}, gpu: {suspicious[1]})")
                restart = True
            elif self.injector.compare(False, initial, result) > 0.0:
                self.log(f"Second rerun: unexpected result is not reproducible on a different GPU, therefore was "
                         f"likely incorrect ({result} != {initial})")
                self._failure(iteration, "Possible persistent error!")
            else:
                self.log(f"Second rerun: unexpected result is reproducible on a different GPU, therefore it was "
                         f"likely correct ({result} = {initial})")
                self._failure(iteration, f"Correct result (but possible Application error) ({self.failed['message']})")
        if self.agree([1.0 if restart else 0.0])[0]:
            self.say("Need to restart job from the same checkpoint because it was scheduled on the same node/GPU")
            self.say("Exiting now. Please resume the job from the same checkpoint to rerun the last iteration and "
                     "establish a diagnostic")
            raise RerunFault(f"--rerun-mode validate_results: iteration {iteration} was re-run on the device that "
                             "faulted; resume from the same checkpoint elsewhere", EXIT_CODE_RESUME_TO_DISAMBIGUATE)
        self.say("Exiting now. A checkpoint at the last iteration already exists if further examination is needed")
        raise RerunFault(f"--rerun-mode validate_results: iteration {iteration} diagnosed from its checkpoint (see "
                         "the lines above)")

    def check(self, iteration: int, loss, rerun, num_validations: int = 2):
        """The step's result after any re-run: `loss` (None off the last stage) is the first
        run's; `rerun()` runs the step again and returns its (loss, extra); `num_validations`:
        how many results Megatron would validate in this step on this rank (2 per micro-batch)."""
        if self.mode == "validate_results":
            if not self.announced:
                self.say("Result validation enabled")
                self.announced = True
            if self.pending:
                self._rerun_from_checkpoint(iteration, loss)
            self._validate(iteration, loss, num_validations)
            self.first_iteration_complete = True
            if not self.agree([0.0 if self.failed is None else 1.0])[0]:
                return None
            self.say("Need to rerun step to check reproducibility of initial result")
            again = rerun()
            if self.agree([1.0 if self._first_rerun(iteration, again[0]) else 0.0])[0]:
                self.say("Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun "
                         "the last iteration and establish a diagnostic")
                raise RerunFault(f"--rerun-mode validate_results: iteration {iteration}'s unexpected result was "
                                 "reproduced; resume from the checkpoint on another device for a diagnosis",
                                 EXIT_CODE_RESUME_TO_DISAMBIGUATE, save_checkpoint=True)
            self.say("Exiting now. The job can be resumed from a previous checkpoint")
            raise RerunFault(f"--rerun-mode validate_results: iteration {iteration}'s unexpected result was not "
                             "reproduced by a re-run: a possible transient error")
        if self.mode == "report_stats":
            again = rerun()
            difference = abs(again[0] - loss) if loss is not None and again[0] is not None else 0.0
            if not (difference == 0.0 or math.isfinite(difference)):
                difference = math.inf
            difference = self.agree([difference])[0]
            self.reruns += 1
            self.differed += difference != 0.0
            self.largest_difference = max(self.largest_difference, difference)
            return again
        return None

    def report(self) -> str | None:
        """report_stats' line for the steps since the last report."""
        if self.mode != "report_stats" or not self.reruns:
            return None
        line = (f"--rerun-mode report_stats: {self.reruns} steps re-run, {self.differed} gave a different loss, "
                f"largest difference {self.largest_difference:.3e}")
        self.reruns = self.differed = 0
        self.largest_difference = 0.0
        return line

    # --- the fault's checkpoint ---------------------------------------------------------------
    def checkpoint_state(self) -> dict:
        """This rank's part of the fault's record, saved with the checkpoint."""
        return {"failed": self.failed, "injector": self.injector.state_dict()}

    def load(self, record: dict | None, world_size: int, same_layout: bool) -> None:
        """Resume from a checkpoint saved by a reproduced fault (`record`: every rank's
        checkpoint_state, in rank order), as Megatron's load_state_dict."""
        if not same_layout:
            self.say("Job sharding has changed: Rerun state will be ignored")
        if record is None or not same_layout:
            return
        if self.mode == "disabled":
            self.say("RerunStateMachine disabled via CLI, ignoring machine state saved in checkpoint")
            return
        if len(record["ranks"]) != world_size:
            return
        self.say("Getting RerunStateMachine state from checkpoint. Will rerun step.")
        mine = record["ranks"][self.rank]
        self.failed = mine["failed"]
        self.injector.load_state_dict(mine["injector"])
        self.pending = True
