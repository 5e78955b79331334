"""Random-number streams for tensor-parallel training.

Dropout on activations that are identical across the TP group (the residual stream without
sequence parallelism) must draw identical masks on every TP rank: it uses torch's default
generator, seeded identically across the group. Dropout on activations that differ per TP rank
(attention probabilities of this rank's heads, sequence-parallel slices) must draw independent
masks: it runs inside `tracker.fork()`, which swaps a per-TP-rank generator state in and out of
torch's default generator for the device.
"""

import contextlib
import random

import numpy as np
import torch

MODEL_PARALLEL_RNG = "model-parallel-rng"
_TP_SEED_OFFSET = 2718  # Megatron's offset, so that seeds match Megatron runs
_PP_SEED_OFFSET = 100


def _get_state(device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        return torch.cuda.get_rng_state(device)
    return torch.get_rng_state()


def _set_state(device: torch.device, state: torch.Tensor) -> None:
    if device.type == "cuda":
        torch.cuda.set_rng_state(state, device)
    else:
        torch.set_rng_state(state)


class RNGTracker:
    """Named generator states for one device, forked into the default generator on demand."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self._states: dict[str, torch.Tensor] = {}

    def add(self, name: str, seed: int) -> None:
        if name in self._states:
            raise ValueError(f"RNG stream {name!r} already exists")
        saved = _get_state(self.device)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                torch.cuda.manual_seed(seed)
        else:
            torch.default_generator.manual_seed(seed)
        self._states[name] = _get_state(self.device)
        _set_state(self.device, saved)

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with stream `name` as the device's default generator."""
        if name not in self._states:
            raise KeyError(f"RNG stream {name!r} was never added")
        saved = _get_state(self.device)
        _set_state(self.device, self._states[name])
        try:
            yield
        finally:
            self._states[name] = _get_state(self.device)
            _set_state(self.device, saved)

    def get_states(self) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in self._states.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._states = {k: v.clone() for k, v in states.items()}


def seed_everything(seed: int, tp_rank: int = 0, pp_rank: int = 0, device="cpu") -> RNGTracker:
    """Seed Python, NumPy and torch as Megatron does; return the tracker of TP-rank streams.

    The default stream is `seed + 100 * pp_rank` (identical across TP and DP); the
    model-parallel stream is that plus 2718 + tp_rank.
    """
    stage_seed = seed + _PP_SEED_OFFSET * pp_rank
    random.seed(stage_seed)
    np.random.seed(stage_seed)
    torch.manual_seed(stage_seed)
    tracker = RNGTracker(device)
    tracker.add(MODEL_PARALLEL_RNG, stage_seed + _TP_SEED_OFFSET + tp_rank)
    return tracker


@contextlib.contextmanager
def rng_fork_if(tracker: RNGTracker | None, enabled: bool):
    """`tracker.fork()` when `enabled` and a tracker exists, else the default stream."""
    if enabled and tracker is not None:
        with tracker.fork():
            yield
    else:
        yield
