"""--error-injection-rate / --error-injection-type: Megatron's fault injection into result
validation (megatron/core/rerun_state_machine.py, RerunErrorInjector), and the comparison of
an initial result with a re-run's (_compare_floats).

Each validation of a result (two per micro-batch on the ranks that compute the loss: the NaN
check and the Inf check) is rejected with probability 1/rate, at most once per iteration:

    transient_error   the first re-run (same device) gives a different result: "Possible
                      transient error", the job stops (exit 17)
    persistent_error  the first re-run reproduces it; the job saves a checkpoint and stops (exit
                      16); re-run from that checkpoint on another device, the result differs:
                      "Possible persistent error" (exit 17)
    correct_result    as persistent_error, but the re-run on another device reproduces it:
                      "Correct result (but possible Application error)" (exit 17)
"""

import math
import os
import random

import torch

INJECTION_TYPES = ("transient_error", "persistent_error", "correct_result")
ERROR_NAMES = {"correct_result": "Expected result", "transient_error": "Transient error",
               "persistent_error": "Persistent error"}
MATCH, MISMATCH = 0.0, math.inf
NAN_MESSAGE = "found NaN in local forward loss calculation"
INF_MESSAGE = "found Inf in local forward loss calculation"


def compare_floats(a: float, b: float) -> float:
    """Megatron's _compare_floats: 0 for equal results (two NaNs are equal), inf when one is
    NaN or infinite and the other not, else the relative difference |a - b| / ((a + b) / 2)."""
    if a == b or (math.isnan(a) and math.isnan(b)):
        return MATCH
    if math.isnan(a) != math.isnan(b) or math.isinf(a) != math.isinf(b):
        return MISMATCH
    if math.isnan(a) or math.isinf(a):  # nan vs inf
        return MISMATCH
    return math.fabs((a - b) / (a + b) * 2)


def device_identity(device: torch.device) -> tuple[str, str]:
    """(node, device) a fault is attributed to, as Megatron's (os.uname()[1], CUDA device): a
    re-run from the checkpoint must happen elsewhere to tell a persistent fault from a correct
    result. On CPU the device is the process's local rank."""
    node = os.uname()[1]
    if device.type == "cuda":
        return node, f"cuda:{torch.cuda.current_device()}"
    return node, f"cpu:{os.environ.get('LOCAL_RANK', '0')}"


class ErrorInjector:
    def __init__(self, rate: int = 0, kind: str = "transient_error", rank: int = 0, seed: int = 0):
        if kind not in INJECTION_TYPES:
            raise ValueError(f"--error-injection-type {kind!r} is not one of {', '.join(INJECTION_TYPES)}")
        self.rate, self.kind, self.rank = rate, kind, rank
        self.random = random.Random(seed)
        self.injected: str | None = None  # the kind injected and not yet settled by a re-run

    def maybe_inject(self) -> bool:
        """Megatron's draw: (randint(0, rate - 1) + rank) % rate == 0, once per iteration."""
        if self.rate <= 0 or self.injected is not None:
            return False
        if (self.random.randint(0, self.rate - 1) + self.rank) % self.rate:
            return False
        self.injected = self.kind
        return True

    def compare(self, first_rerun: bool, initial: float, result: float) -> float:
        """The comparison of a re-run's result, forced by an injected fault: a transient one
        differs on the first re-run; a persistent one matches there and differs on the re-run
        from the checkpoint; a correct result matches both times."""
        if self.injected is None:
            return compare_floats(initial, result)
        if first_rerun:
            if self.injected == "transient_error":
                self.injected = None
                return MISMATCH
            return MATCH
        kind, self.injected = self.injected, None
        return MISMATCH if kind == "persistent_error" else MATCH

    def state_dict(self) -> dict:
        _, internal, gauss = self.random.getstate()
        return {"rate": self.rate, "kind": self.kind, "injected": self.injected, "random": list(internal),
                "random_gauss": gauss}

    def load_state_dict(self, state: dict) -> None:
        self.rate, self.kind, self.injected = state["rate"], state["kind"], state["injected"]
        self.random.setstate((3, tuple(state["random"]), state["random_gauss"]))
