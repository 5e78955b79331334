"""MemTracker over one training step, without the leak torch's module tracker adds.

torch.distributed._tools.mod_tracker.ModTracker (MemTracker's own, and the one the dry run
names modules by) learns that a module's backward has ended from a hook on the gradients of the
module's inputs (register_multi_grad_hook in "all" mode, torch 2.13). That hook's closure holds
the inputs' autograd nodes and is itself held by one of those nodes: a reference cycle through
C++ that Python's garbage collector cannot see, so the nodes outlive the backward, and through
their edges so does every leaf tensor upstream (a leaf's gradient accumulator holds the leaf).
A pipeline stage's received activation is such a leaf (it requires grad to give the previous
stage its gradient): under torch's tracker every micro-batch's received input, with its .grad,
lived to the end of the step — the dry run's interleaved and middle stages held two activation
messages per micro-batch more than the run (and the real runs measured with MemTracker alike).
`AcyclicModTracker` registers that hook in "any" mode, whose closure holds no node: the module
then leaves the backward stack at its first input gradient rather than its last, the same
moment for the single-input modules of a transformer.

Under FSDP2 the parameters are DTensors, and DTensor derives each op's output shape by running
the op on fake global-shape tensors in the active FakeTensorMode (torch 2.13's
ShardingPropagator._propagate_tensor_meta_non_cached): inside the dry run that is the dry run's
own mode, so MemTracker counted those full-size stand-ins as allocations (16 times a rank's
parameter shard in Adam's step, none of which a GPU allocates). `StepMemTracker` counts no op
run during that propagation.
"""

import weakref
from copy import deepcopy

import torch
from torch.autograd.graph import register_multi_grad_hook
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.distributed._tools.mod_tracker import ModTracker
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._pytree import tree_flatten


class AcyclicModTracker(ModTracker):
    """ModTracker whose backward-end hooks keep no autograd node (and so no tensor) alive."""

    def _fw_pre_hook(self, mod, input):
        if torch._dynamo.eval_frame._is_in_optimized_module():
            return
        name, w_mod = self._get_mod_name(mod), weakref.ref(mod)
        self._get_append_fn(w_mod, name, False)()
        if self._user_pre_fw_hook is not None:
            self._user_pre_fw_hook(mod, input)
        if self.is_bw:
            return
        args, _ = tree_flatten(input)
        tensors = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        backward_done = self._get_pop_fn(w_mod, name, True)
        if tensors:
            register_multi_grad_hook(tensors, backward_done, mode="any")
        else:
            self._post_bw_callbacks_to_enqueue.append(backward_done)


class StepMemTracker(MemTracker):
    """MemTracker over one training step of several micro-batches: MemTracker refuses a root
    module's second forward (it takes it for a new iteration); here it is the next micro-batch
    of the same step, whose per-module statistics (unused) are left as the first one's. Also
    keeps the most activation bytes held at any moment, per device."""

    def __init__(self):
        super().__init__()
        self._mod_tracker = AcyclicModTracker()
        self.activation_peak: dict = {}
        self._propagating = 0  # inside DTensor's shape propagation (not a device allocation)
        self._propagate = None

    def __enter__(self):
        propagate = self._propagate = ShardingPropagator._propagate_tensor_meta_non_cached
        tracker = self

        def propagate_untracked(*args, **kwargs):
            tracker._propagating += 1
            try:
                return propagate(*args, **kwargs)
            finally:
                tracker._propagating -= 1

        ShardingPropagator._propagate_tensor_meta_non_cached = propagate_untracked
        return super().__enter__()

    def __exit__(self, *args):
        ShardingPropagator._propagate_tensor_meta_non_cached = self._propagate
        return super().__exit__(*args)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if self._propagating:
            return func(*args, **(kwargs or {}))
        return super().__torch_dispatch__(func, types, args, kwargs)

    def _pre_fw_hook(self, module, inputs) -> None:
        if module in self.memory_tracking and not self._mod_tracker.is_bw:
            return
        super()._pre_fw_hook(module, inputs)

    def _update_peak_stats(self, peak_state) -> None:
        # the device-wide peak only: MemTracker's own walks every module tracked on every op for
        # per-module peaks that are not used here (two fifths of a Llama-3 405B stage's time)
        for dev, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[dev] = snap[_TOTAL_KEY]
                self._peak_mem_snap[dev] = deepcopy(snap)
            if snap[_MemRefType.ACT] > self.activation_peak.get(dev, 0):
                self.activation_peak[dev] = snap[_MemRefType.ACT]
