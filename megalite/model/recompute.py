"""Activation recompute that replays dropout exactly, including the TP-rank RNG streams."""

import contextlib

import torch.utils.checkpoint


@contextlib.contextmanager
def _tracker_states(tracker, states):
    current = tracker.get_states()
    tracker.set_states(states)
    try:
        yield
    finally:
        tracker.set_states(current)


def checkpointed(fn, tracker, *args):
    """Run fn(*args) without keeping its activations; recompute them in backward.

    torch restores the default generator for the recomputation; the tracker's named streams
    (used by dropout inside tensor-parallel regions) are restored here."""
    if tracker is None:
        contexts = None
    else:
        snapshot = tracker.get_states()

        def contexts():
            return contextlib.nullcontext(), _tracker_states(tracker, snapshot)

    kwargs = {"context_fn": contexts} if contexts else {}
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)
