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


def _checkpoint_with_tracker(fn, tracker, *args):
    snapshot = tracker.get_states()

    def contexts():
        return contextlib.nullcontext(), _tracker_states(tracker, snapshot)

    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True,
                                             context_fn=contexts)


# Dynamo cannot trace a checkpoint whose context_fn is a closure, nor the tracker's
# get/set_rng_state: inside a compiled layer this runs eagerly (a graph break).
_checkpoint_with_tracker_eager = torch.compiler.disable(_checkpoint_with_tracker)


def checkpointed(fn, tracker, *args):
    """Run fn(*args) without keeping its activations; recompute them in backward.

    torch restores the default generator for the recomputation; the tracker's named streams
    (used by dropout inside tensor-parallel regions) are restored here. Pass tracker=None when
    fn draws nothing from the tracker: inside a torch.compile'd layer the checkpoint is then
    traced into the graph; with a tracker it runs eagerly there."""
    if tracker is None:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    if torch.compiler.is_compiling():
        return _checkpoint_with_tracker_eager(fn, tracker, *args)
    return _checkpoint_with_tracker(fn, tracker, *args)
