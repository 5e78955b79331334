"""Fine-grained activation offloading (Megatron's --fine-grained-activation-offloading with
--offload-modules): what the named submodules save for backward leaves the device after their
forward and comes back before their backward.

Each call of a named submodule is one group (Megatron's OffloadTensorGroup). While it runs, a
saved_tensors_hooks pair records the tensors autograd saves (not the module's parameters, not
tensors under --min-offloaded-tensor-size elements; each view once, and a strided slice that
covers half its storage or more as that whole storage, once, as Megatron does); when it returns they
are copied to pinned CPU memory on a side CUDA stream (after that stream waits for the compute
stream, so the copies overlap the next modules' compute) and the device copies are dropped, their
memory reused once the copy is done (record_stream). In backward, once a group's backward is done
(a hook on its input's gradient) the group before it in the same micro-batch is
copied back on a second stream (prefetch); the compute stream waits for that copy only when the
tensors are unpacked. A group no prefetch reached (the last of a micro-batch) is reloaded when
first unpacked. On a CPU device (and on the dry run's fake device) the copies are synchronous:
an offload is a copy to CPU memory, and a fake device's bytes move to the fake CPU.

Which groups offload after the first (warm-up) step is Megatron's policy: offload_plan.py (the
last group of each name where its backward comes next, --activation-offload-fraction,
--delta-offload-bytes-across-pp-ranks, --fine-grained-offloading-max-inflight-offloads).
"""

import contextlib
import weakref

import torch
from torch.autograd.graph import saved_tensors_hooks

from megalite.kernels.dispatch import on_real_cuda
from megalite.model.offload_plan import OffloadPlan

OFFLOAD_MODULES = ("attn_norm", "qkv_linear", "core_attn", "attn_proj", "mlp_norm", "expert_fc1", "moe_act")
"""Megatron's --offload-modules names megalite's layers have (what each group covers: the
model/README.md table)."""


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata  # the StorageImpl: shared by every view, fake tensors included


def _dense(t: torch.Tensor) -> bool:
    """Whether t's elements fill its storage span without gaps or overlaps (a permuted layout)."""
    return all(st > 0 for st in t.stride()) and 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) == t.numel()


def _empty_like_layout(t: torch.Tensor, device, pin_memory: bool = False) -> torch.Tensor:
    """An uninitialised tensor with t's shape, dtype and strides where those are dense, so that a
    reloaded tensor runs the backward kernels the original would have; contiguous otherwise (a
    slice of a wider tensor is copied alone, not with the span it strides over)."""
    if t.is_contiguous() or t.numel() == 0 or not _dense(t):
        return torch.empty(t.shape, dtype=t.dtype, device=device, pin_memory=pin_memory)
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device, pin_memory=pin_memory)


def _spans_most_of_its_storage(t: torch.Tensor) -> bool:
    """A view with gaps that covers at least half its storage (Megatron's rule for offloading the
    storage rather than a contiguous copy)."""
    if t.is_contiguous() or t.numel() == 0 or _dense(t):
        return False
    nbytes = t.untyped_storage().nbytes()
    return nbytes % t.element_size() == 0 and 2 * t.numel() * t.element_size() >= nbytes


def _whole_storage(t: torch.Tensor) -> torch.Tensor:
    """A flat tensor of t's dtype over all of t's storage."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage())


class _Slot:
    """One saved tensor of a group: on the device until the group commits, then on the host
    until reloaded."""

    __slots__ = ("device_tensor", "host", "device")

    def __init__(self, t):
        self.device_tensor, self.host, self.device = t, None, t.device


class _Outer:
    """A saved tensor the enclosing saved_tensors_hooks took (a RecomputedOutput that rebuilds
    it, a checkpoint that recomputes it): recompute wins over offloading, as in Megatron."""

    __slots__ = ("unpack", "packed")

    def __init__(self, unpack, packed):
        self.unpack, self.packed = unpack, packed


def _prefetcher(previous):
    """A hook on a group's input gradient, computed once the group's backward is done: the
    moment to start reloading the group before it (`previous`, a weak reference). A hook, not an
    identity op, so that the input's gradients are summed in the same order as without offloading."""
    def prefetch(grad):
        group = previous()
        if group is not None:
            group.reload(prefetch=True)
    return prefetch


class OffloadGroup:
    """The tensors one call of a named submodule saves for backward (pack and unpack are its
    saved_tensors_hooks pair; a RecomputedOutput keeps its inputs through them too)."""

    def __init__(self, offloader, name: str, x: torch.Tensor, previous, keep, outer_hooks, chunk, record):
        # weak: a group lives while autograd holds its saved tensors, no longer
        self.offloader, self.name, self.previous = offloader, name, previous
        self.chunk, self.record = chunk, record  # its offload_plan records
        self._kept = {_storage_key(t) for t in keep}
        self._outer_hooks = outer_hooks
        self._slots: list[_Slot] = []
        self._index: dict = {}
        self._offloaded = self._reloaded = None  # CUDA events of the side streams' copies
        self._reload_started = False
        self.input = x
        if x.requires_grad:
            x.register_hook(_prefetcher(previous))

    def pack(self, t: torch.Tensor):
        if self._outer_hooks is not None:
            packed = self._outer_hooks[0](t)
            if packed is not t:
                return _Outer(self._outer_hooks[1], packed)
        if (t.numel() < self.offloader.min_tensor_size or t.device.type not in ("cuda", "cpu")
                or _storage_key(t) in self._kept):
            return t
        view = None
        if _spans_most_of_its_storage(t):
            # a strided slice (SwiGLU's halves of one matmul output): the whole storage is copied,
            # once for all its views, and the slice rebuilt with its own strides (a contiguous copy
            # could take other kernels in backward, other roundings)
            view, t = (tuple(t.shape), t.stride(), t.storage_offset()), _whole_storage(t)
            key = (_storage_key(t), t.dtype)
        else:
            key = (_storage_key(t), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)
        if key not in self._index:
            self._index[key] = len(self._slots)
            self._slots.append(_Slot(t))
        return self, self._index[key], view

    @staticmethod
    def unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        if isinstance(packed, _Outer):
            return packed.unpack(packed.packed)
        group, index, view = packed
        t = group.fetch(index)
        return t if view is None else t.as_strided(*view)

    def commit(self) -> None:
        """Copy the recorded tensors to the host and drop the device copies (the module returned)."""
        real_cuda = [s for s in self._slots if on_real_cuda(s.device_tensor)]
        if real_cuda:
            d2h, _ = self.offloader.streams()
            d2h.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(d2h):
                for slot in real_cuda:
                    slot.host = _empty_like_layout(slot.device_tensor, "cpu", pin_memory=True)
                    slot.host.copy_(slot.device_tensor, non_blocking=True)
                    slot.device_tensor.record_stream(d2h)  # its memory is reused only after the copy
            self._offloaded = d2h.record_event()
        for slot in self._slots:
            if slot.host is None:
                slot.host = _empty_like_layout(slot.device_tensor, "cpu")
                slot.host.copy_(slot.device_tensor)
            self.offloader.count(self.name, slot.host)
            self.record.bytes += slot.host.numel() * slot.host.element_size() if self.offloader.plan.warmup else 0
            slot.device_tensor = None
        self.offloader.plan.joined(self.chunk, self.name, self._offloaded)

    def reload(self, prefetch: bool = False) -> None:
        """Start copying the group back to its device (on the side stream on CUDA)."""
        if self._reload_started or not self._slots:
            return
        self._reload_started = True
        self.offloader.reloads["prefetched" if prefetch else "on_demand"] += 1
        real_cuda = [s for s in self._slots if s.device.type == "cuda" and s.host.is_pinned()]
        if real_cuda:
            _, h2d = self.offloader.streams()
            h2d.wait_stream(torch.cuda.current_stream())
            h2d.wait_event(self._offloaded)
            with torch.cuda.stream(h2d):
                for slot in real_cuda:
                    slot.device_tensor = _empty_like_layout(slot.host, slot.device)
                    slot.device_tensor.copy_(slot.host, non_blocking=True)
            self._reloaded = h2d.record_event()
        for slot in self._slots:
            if slot.device_tensor is None:
                slot.device_tensor = slot.host if slot.device.type == "cpu" else slot.host.to(slot.device)

    def fetch(self, index: int) -> torch.Tensor:
        self.reload()
        t = self._slots[index].device_tensor
        if self._reloaded is not None and on_real_cuda(t):
            stream = torch.cuda.current_stream()
            stream.wait_event(self._reloaded)
            t.record_stream(stream)  # made on the side stream, freed after the compute stream's use
        return t


class _NotOffloaded:
    """A region of a module that is not offloaded: its input as it is, saved tensors kept."""

    def __init__(self, x):
        self.input = x

    @staticmethod
    def pack(t):
        return t

    @staticmethod
    def unpack(t):
        return t


class ActivationOffloader:
    """The offloading state of one model chunk: the modules named, the side streams, the chunk
    record of the micro-batch in flight and its last offloaded group (the next group's prefetch
    target), the rank's OffloadPlan (shared by its model chunks), and the bytes and tensors
    copied to the host per module name since it was made."""

    def __init__(self, modules=(), min_tensor_size: int = 1024 * 1024, plan: OffloadPlan | None = None):
        if unknown := sorted(set(modules) - set(OFFLOAD_MODULES)):
            raise ValueError(f"offload modules {unknown}: unknown (valid: {', '.join(OFFLOAD_MODULES)})")
        self.modules, self.min_tensor_size = frozenset(modules), min_tensor_size
        self.plan = plan or OffloadPlan()
        self._streams = None
        self._previous = lambda: None  # a weak reference to the last group
        self._chunk = self._chunk_started = None
        self.offloaded_bytes: dict[str, int] = {}
        self.offloaded_tensors: dict[str, int] = {}
        self.offloaded_groups: dict[str, int] = {}
        self.reloads = {"prefetched": 0, "on_demand": 0}  # groups reloaded ahead of their backward, or at it

    def offloads(self, name: str) -> bool:
        return name in self.modules

    def streams(self):
        """(device-to-host, host-to-device) side streams, made on first use."""
        if self._streams is None:
            self._streams = (torch.cuda.Stream(), torch.cuda.Stream())
        return self._streams

    def new_micro_batch(self) -> None:
        """A micro-batch's forward starts: its first group prefetches nothing before it, and
        its first group starts a new chunk of the plan."""
        self._previous = lambda: None
        self._chunk_started = False

    def end_forward(self, x: torch.Tensor) -> torch.Tensor:
        """x, the micro-batch's output of this model chunk's layers: when its gradient comes, the
        chunk's backward starts (the plan's order of backwards)."""
        chunk = self._chunk if self._chunk_started else None
        if chunk is not None and x.requires_grad:
            x.register_hook(lambda grad: self.plan.backward_started(chunk))
        return x

    def count(self, name: str, host: torch.Tensor) -> None:
        self.offloaded_bytes[name] = self.offloaded_bytes.get(name, 0) + host.numel() * host.element_size()
        self.offloaded_tensors[name] = self.offloaded_tensors.get(name, 0) + 1

    def _start_group(self, name: str):
        """The plan's chunk and group record of a group about to run, and whether it offloads."""
        if not self._chunk_started:
            self._chunk, self._chunk_started = self.plan.start_chunk(), True
        if self._chunk is None:
            return None, None, False
        record, offload = self.plan.start_group(self._chunk, name)
        return self._chunk, record, offload

    @contextlib.contextmanager
    def region(self, name: str, x: torch.Tensor, keep=()):
        """Run a named submodule on `region.input` (x) inside the block: with
        `name` offloaded and autograd recording, what the block saves for backward is offloaded when
        it ends (unless the plan keeps this group). `keep`: tensors (the module's weights, or tensors
        made from them) never offloaded."""
        if name not in self.modules or not torch.is_grad_enabled():
            yield _NotOffloaded(x)
            return
        chunk, record, offload = self._start_group(name)
        if not offload:
            yield _NotOffloaded(x)
            return
        # saved_tensors_hooks do not nest (the innermost pair sees every tensor): the enclosing
        # pair, if any, is asked first
        outer_hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
        group = OffloadGroup(self, name, x, self._previous, keep, outer_hooks, chunk, record)
        self._previous = weakref.ref(group)
        with saved_tensors_hooks(group.pack, group.unpack):
            yield group
        group.input = None  # the group outlives the block (autograd holds it): not its input
        group.commit()
        self.offloaded_groups[name] = self.offloaded_groups.get(name, 0) + 1


def end_offload_step(models) -> None:
    """A training step's forwards and backwards are done on these model chunks (one rank's):
    their plan decides after the warm-up step (Megatron resets its offload manager there)."""
    for plan in {id(m.offloader.plan): m.offloader.plan for m in models}.values():
        plan.end_step()


def share_offload_plan(models) -> None:
    """One plan for a rank's model chunks (virtual stages): Megatron's is per process."""
    for model in models[1:]:
        model.offloader.plan = models[0].offloader.plan


def parameters_of(*modules) -> list:
    """The tensors a region keeps: its modules' parameters (under FSDP2 the unsharded ones)."""
    return [p.to_local() if hasattr(p, "to_local") else p for m in modules if m is not None for p in m.parameters()]
