"""--rerun-mode: re-run a training step's forward and backward on the same micro-batches with
the same random state, as Megatron's rerun state machine does, to tell a transient fault from a
persistent one.

    validate_results  a step whose loss is NaN or infinite (on any rank) is re-run. Reproduced:
                      a persistent fault (the data or the model), the run stops with one line
                      (RerunFault). Not reproduced: a transient fault (hardware, a race), reported
                      in one line; training goes on with the re-run's result (Megatron instead
                      checkpoints and exits so the job restarts on other hardware).
    report_stats      every step is run twice; every --log-interval one line reports how many
                      re-runs gave a different loss and the largest difference.
    disabled          nothing is re-run (a NaN iteration is counted, as megalite always does).

The step's micro-batches are kept (a list of this step's batches, only on ranks that read data)
and the RNG states (torch's CPU and CUDA generators and the model-parallel tracker) are saved
before the first run and restored before the re-run.
"""

import math

import torch


class RerunFault(RuntimeError):
    """A persistent fault found by --rerun-mode validate_results."""


def finite(loss) -> bool:
    return loss is None or math.isfinite(loss)


class RerunState:
    def __init__(self, mode: str, tracker, device, agree, say):
        """`agree(values) -> values`: the element-wise maximum over all ranks; `say`: rank 0's print."""
        self.mode, self.tracker, self.device, self.agree, self.say = mode, tracker, device, agree, say
        self.reruns = self.differed = 0
        self.largest_difference = 0.0

    @property
    def active(self) -> bool:
        return self.mode != "disabled"

    def save_rng(self) -> dict:
        state = {"cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            state["cuda"] = torch.cuda.get_rng_state(self.device)
        if self.tracker is not None:
            state["tracker"] = {k: v.clone() for k, v in self.tracker.get_states().items()}
        return state

    def restore_rng(self, state: dict) -> None:
        torch.set_rng_state(state["cpu"])
        if "cuda" in state:
            torch.cuda.set_rng_state(state["cuda"], self.device)
        if "tracker" in state:
            self.tracker.set_states(state["tracker"])

    def check(self, iteration: int, loss, rerun):
        """The step's result after any re-run: `loss` (None off the last stage) is the first
        run's; `rerun()` runs the step again and returns its (loss, extra)."""
        if self.mode == "validate_results":
            if not self.agree([0.0 if finite(loss) else 1.0])[0]:
                return None
            again = rerun()
            if self.agree([0.0 if finite(again[0]) else 1.0])[0]:
                raise RerunFault(f"--rerun-mode validate_results: iteration {iteration}: the loss is not finite "
                                 "and the re-run on the same data with the same random state reproduced it: a "
                                 "persistent fault (the data or the model), stopping")
            self.say(f"--rerun-mode validate_results: iteration {iteration}: the loss was not finite and the "
                     f"re-run on the same data gave a finite loss: a transient fault; going on with the re-run")
            return again
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
