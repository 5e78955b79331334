"""Activation recompute that replays dropout exactly, including the TP-rank RNG streams."""

import contextlib

import torch
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
# get/set_rng_state: inside a compiled layer this runs eagerly (a graph break). Made on first
# need: torch.compiler.disable imports torch._dynamo, inductor and triton, seconds added to
# every process's start-up (each spawned rank, each tool) that never compiles.
_EAGER_UNDER_COMPILE: dict[str, object] = {}


def prepare_for_compile() -> None:
    """Make the eager checkpoint before any region is compiled (GPTModel.compile_regions calls
    it): made while tracing, it would cost one more graph break."""
    if "checkpoint" not in _EAGER_UNDER_COMPILE:
        _EAGER_UNDER_COMPILE["checkpoint"] = torch.compiler.disable(_checkpoint_with_tracker)


def checkpointed(fn, tracker, *args):
    """Run fn(*args) without keeping its activations; recompute them in backward.

    torch restores the default generator for the recomputation; the tracker's named streams
    (used by dropout inside tensor-parallel regions) are restored here. Pass tracker=None when
    fn draws nothing from the tracker: inside a torch.compile'd layer the checkpoint is then
    traced into the graph; with a tracker it runs eagerly there."""
    if tracker is None:
        return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False, preserve_rng_state=True)
    if torch.compiler.is_compiling():
        prepare_for_compile()
        return _EAGER_UNDER_COMPILE["checkpoint"](fn, tracker, *args)
    return _checkpoint_with_tracker(fn, tracker, *args)


class RecomputedOutput:
    """fn(*inputs) (a tensor or a tuple of tensors), whose result the modules after it do not
    keep for backward: while `consumers()` is open, a tensor they save that is a result (or a
    view of one) is stored as its shape and offsets, and rebuilt by running fn again on the same
    inputs when backward needs it (Megatron's output-discarding checkpoint of --recompute-modules
    layernorm, moe_act and mla_up_proj). fn must be deterministic (no dropout); its own backward
    keeps what it saved. `store` (an offload region: megalite.model.offload) keeps the inputs
    through its pack and unpack, so that they are offloaded with what fn saves."""

    def __init__(self, fn, *inputs, store=None):
        self.fn = fn
        self.output = fn(*inputs)
        self.store, self._is_tensor = store, tuple(isinstance(x, torch.Tensor) for x in inputs)
        self.inputs = inputs if store is None else tuple(
            store.pack(x) if is_tensor else x for x, is_tensor in zip(inputs, self._is_tensor))
        outputs = self.output if isinstance(self.output, tuple) else (self.output,)
        # A fresh contiguous result can be rebuilt with the same layout; anything else is kept.
        # Keyed by the StorageImpl, not the data pointer: every fake tensor's (the dry run's) is 0.
        self._discardable = {out.untyped_storage()._cdata: (i, out.dtype) for i, out in enumerate(outputs)
                             if out.numel() > 0 and out.is_contiguous() and out.storage_offset() == 0}
        self._rebuilt = None

    def _pack(self, saved):
        index, dtype = self._discardable.get(saved.untyped_storage()._cdata, (None, None))
        if index is not None and saved.dtype == dtype:
            return (self, index, saved.size(), saved.stride(), saved.storage_offset())
        return saved

    @staticmethod
    def _unpack(packed):
        if not isinstance(packed, tuple):
            return packed
        self, index, size, stride, offset = packed
        if self._rebuilt is None:
            inputs = self.inputs if self.store is None else tuple(
                self.store.unpack(x) if is_tensor else x for x, is_tensor in zip(self.inputs, self._is_tensor))
            with torch.no_grad():
                rebuilt = self.fn(*(x.detach() if isinstance(x, torch.Tensor) else x for x in inputs))
            self._rebuilt = rebuilt if isinstance(rebuilt, tuple) else (rebuilt,)
        return self._rebuilt[index].as_strided(size, stride, offset)

    @contextlib.contextmanager
    def consumers(self):
        """The region whose saved copies of `output` are rebuilt instead of kept; `output` is
        released at its end (the caller's references should end there too)."""
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
                yield self.output
        finally:
            self.output = None
