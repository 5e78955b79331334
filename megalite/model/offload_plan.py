"""Which offload groups leave the device (Megatron's PipelineOffloadManager policy, its
post_warmup_callback and should_bulk_offload).

The first training step is the warm-up: every group of the --offload-modules is offloaded and the
plan records, per chunk (one model chunk's forward of one micro-batch, in this rank's forward
order), each group's name and the bytes it copied, and the order in which the chunks' backwards
start. When that step ends the plan keeps on the device, once and for all steps after it:

1. the last group of each name (forward order) of the chunk whose backward runs first, for as
   many names as the chunk with the most names has (Megatron's offload margin);
2. --delta-offload-bytes-across-pp-ranks: on pipeline rank r, the first groups in backward-chunk
   order until r x delta bytes are kept;
3. --activation-offload-fraction f: in each chunk, of the groups still offloaded that copied any
   bytes, the last int(n x (1 - f)) in forward order (a fraction of groups, not of bytes).

And at every later step, while a chunk runs its forward: when every chunk whose backward comes
before its own has started its backward (so its backward is next; always so without pipelining),
the last group of each name in it stays, as its backward would reload it at once.

--fine-grained-offloading-max-inflight-offloads N: after each offload the compute stream waits
for the copies of the same name in the same chunk beyond the newest N (a join; none when unset).
"""

from collections import deque

import torch


class GroupRecord:
    """One group of the warm-up step: its module name, the bytes it copied, whether it offloads."""

    __slots__ = ("name", "bytes", "offload", "last_of_name")

    def __init__(self, name: str):
        self.name, self.bytes, self.offload = name, 0, True
        self.last_of_name = False  # the chunk's last group of this name (set after the warm-up)


class ChunkRecord:
    """One model chunk's forward of one micro-batch: its groups in forward order."""

    def __init__(self, index: int):
        self.index = index
        self.groups: list[GroupRecord] = []
        self.names: frozenset = frozenset()  # of its groups (set after the warm-up)
        self.next_group = 0  # groups started in this step's forward
        self.inflight: dict[str, deque] = {}  # name -> offloads not yet joined (their events)


class OffloadPlan:
    """The offloading policy of one pipeline rank, shared by its model chunks' offloaders."""

    def __init__(self, fraction: float = 1.0, delta_bytes: int = 0, pp_rank: int = 0,
                 max_inflight: int | None = None):
        self.fraction, self.delta_bytes, self.pp_rank = fraction, delta_bytes, pp_rank
        self.max_inflight = max_inflight
        self.warmup = True
        self.chunks: list[ChunkRecord] = []  # forward order, as recorded in the warm-up step
        self.backward_order: list[int] = []  # chunk indexes in the order their backwards started
        self._forwards = 0  # chunks whose forward started in this step
        self._backwards_started: set[int] = set()
        self.joins: dict[str, int] = {}  # per name: compute-stream waits on earlier offloads

    def start_chunk(self) -> ChunkRecord | None:
        """The next chunk of this step (None past the warm-up's: Megatron offloads nothing there)."""
        index, self._forwards = self._forwards, self._forwards + 1
        if self.warmup:
            self.chunks.append(ChunkRecord(index))
        return self.chunks[index] if index < len(self.chunks) else None

    def backward_started(self, chunk: ChunkRecord) -> None:
        if chunk.index in self._backwards_started:
            return
        self._backwards_started.add(chunk.index)
        if self.warmup:
            self.backward_order.append(chunk.index)

    def start_group(self, chunk: ChunkRecord, name: str) -> tuple[GroupRecord, bool]:
        """The record of the chunk's next group (named `name`) and whether it offloads now."""
        position, chunk.next_group = chunk.next_group, chunk.next_group + 1
        if self.warmup:
            chunk.groups.append(GroupRecord(name))
            return chunk.groups[-1], True
        if position >= len(chunk.groups) or chunk.groups[position].name != name:
            raise RuntimeError(f"offload group {position} of chunk {chunk.index} is {name}, in the warm-up step "
                               f"{'none' if position >= len(chunk.groups) else chunk.groups[position].name}: the "
                               "model's forward changed after the first step")
        record = chunk.groups[position]
        if not record.offload:
            return record, False
        return record, not (record.last_of_name and self._backward_is_next(chunk, name))

    def _backward_is_next(self, chunk: ChunkRecord, name: str) -> bool:
        """Whether every chunk holding a group `name` whose backward comes before this one's has
        started its backward (Megatron's front_backward_chunk(name) is this chunk)."""
        for index in self.backward_order:
            if index == chunk.index:
                return True
            if index not in self._backwards_started and name in self.chunks[index].names:
                return False
        return False

    def joined(self, chunk: ChunkRecord, name: str, event) -> None:
        """An offload of `name` was issued (`event`: its copy's CUDA event, None when synchronous):
        with a cap, the compute stream waits for the ones beyond the newest max_inflight."""
        if self.max_inflight is None:
            return
        queue = chunk.inflight.setdefault(name, deque())
        queue.append(event)
        while len(queue) > self.max_inflight:
            oldest = queue.popleft()
            if oldest is not None:
                torch.cuda.current_stream().wait_event(oldest)
            self.joins[name] = self.joins.get(name, 0) + 1

    def end_step(self) -> None:
        """A training step's forwards and backwards are done: after the warm-up step, decide."""
        if self.warmup and self.chunks:
            self.warmup = False
            self._decide()
        self._forwards = 0
        self._backwards_started.clear()
        for chunk in self.chunks:
            chunk.next_group = 0
            chunk.inflight.clear()

    def _decide(self) -> None:
        seen = set(self.backward_order)  # then any chunk whose backward did not start, in forward order
        self.backward_order += [c.index for c in self.chunks if c.index not in seen]
        order = [self.chunks[i] for i in self.backward_order]
        for chunk in self.chunks:
            chunk.names = frozenset(g.name for g in chunk.groups)
            later: set[str] = set()
            for group in reversed(chunk.groups):
                group.last_of_name = group.name not in later
                later.add(group.name)
        margin = max(len({g.name for g in c.groups}) for c in self.chunks)
        last_of_name: dict[str, GroupRecord] = {}
        for chunk in reversed(order):  # ends with the first backward chunk's last group of each name
            for group in chunk.groups:
                last_of_name[group.name] = group
        for group in list(last_of_name.values())[:margin]:
            group.offload = False
        keep_bytes = self.pp_rank * self.delta_bytes
        for group in (g for c in order for g in c.groups):
            if group.offload and keep_bytes > 0:
                keep_bytes -= group.bytes
                group.offload = False
        for chunk in order:
            eligible = [g for g in chunk.groups if g.offload and g.bytes > 0]
            kept = int(len(eligible) * (1 - self.fraction))  # Megatron's expression, rounding included
            for group in eligible[len(eligible) - kept:]:
                group.offload = False
