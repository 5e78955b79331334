"""The vocabulary pipeline schedules are written in: actions, virtual stages, and where the
point-to-point transfers go.

A schedule is, for one pipeline rank, an ordered list of `Action`s. Compute actions:

    F  forward of micro-batch `microbatch` through local chunk `chunk`
    B  backward of it: the full backward, or only the input gradient where the schedule also
       lists a W for the same (chunk, microbatch) (zero-bubble schedules split it)
    W  weight-gradient half of a split backward

Communication actions name the chunk and micro-batch on *this* rank; the peer is implied:

    RECV_F  receive the input activation of F(chunk, microbatch) from the previous virtual stage
    SEND_F  send the output activation of F(chunk, microbatch) to the next virtual stage
    RECV_B  receive the output gradient B(chunk, microbatch) needs from the next virtual stage
    SEND_B  send the input gradient B(chunk, microbatch) produced to the previous virtual stage

Virtual stages are numbered as in Megatron: local chunk c of pipeline rank r is global
virtual stage c*p + r, so activations travel rank 0 -> 1 -> ... -> p-1 -> 0 (next chunk) and
gradients the reverse way. The first virtual stage is (rank 0, chunk 0), the last is
(rank p-1, chunk v-1).

Executor rule (what makes these lists safe to run with torch.distributed.batch_isend_irecv):
walk the list in order and issue every maximal run of consecutive communication actions as
ONE batch_isend_irecv call, operations in list order (`comm_batches` does the grouping).
Before a compute action runs, wait on the receives issued so far. Sends need not be waited on
before computing: wait on them before the step ends, keeping each sent tensor alive until
then. The simulator checks every schedule under this rule (its default, buffered sends) and
under the stricter one Megatron's p2p code follows (wait on every request of a batch, sends
included, before moving on; `rendezvous=True`): neither deadlocks, and every rank's i-th send
to a peer is that peer's i-th receive from it, as NCCL and gloo match them in order. GPipe,
1F1B and interleaved 1F1B lose no time under the stricter rule; ZB-H1 does, because its
deferred W's only fill the bubble if a send does not hold its rank until the peer receives.
"""

from dataclasses import dataclass

F = "F"
B = "B"
W = "W"
SEND_F = "SEND_F"
RECV_F = "RECV_F"
SEND_B = "SEND_B"
RECV_B = "RECV_B"

COMPUTE_KINDS = (F, B, W)
COMM_KINDS = (SEND_F, RECV_F, SEND_B, RECV_B)


@dataclass(frozen=True)
class Action:
    """One step of a rank's schedule: `kind` on local `chunk` for `microbatch`."""

    kind: str
    chunk: int
    microbatch: int

    def __post_init__(self):
        if self.kind not in COMPUTE_KINDS + COMM_KINDS:
            raise ValueError(f"unknown action kind {self.kind!r}; expected one of "
                             f"{COMPUTE_KINDS + COMM_KINDS}")
        if self.chunk < 0 or self.microbatch < 0:
            raise ValueError(f"{self.kind}: chunk and microbatch must be >= 0, got "
                             f"chunk={self.chunk} microbatch={self.microbatch}")

    @property
    def is_compute(self) -> bool:
        return self.kind in COMPUTE_KINDS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    @property
    def is_send(self) -> bool:
        return self.kind in (SEND_F, SEND_B)

    def __str__(self) -> str:
        return f"{self.kind}(c{self.chunk},mb{self.microbatch})"


def virtual_stage(rank: int, chunk: int, pipeline_size: int) -> int:
    """Global virtual stage of local `chunk` on pipeline `rank` (Megatron numbering)."""
    return chunk * pipeline_size + rank


def stage_coords(stage: int, pipeline_size: int) -> tuple[int, int]:
    """(rank, chunk) holding global virtual stage `stage`."""
    return stage % pipeline_size, stage // pipeline_size


def peer(action: Action, rank: int, pipeline_size: int, num_chunks: int) -> tuple[int, Action]:
    """The rank on the other end of a communication action, and the action it must run.

    SEND_F on stage s pairs with RECV_F on stage s+1; SEND_B on stage s with RECV_B on s-1.
    """
    stage = virtual_stage(rank, action.chunk, pipeline_size)
    last = pipeline_size * num_chunks - 1
    step, counterpart = {
        SEND_F: (+1, RECV_F), RECV_F: (-1, SEND_F), SEND_B: (-1, RECV_B), RECV_B: (+1, SEND_B),
    }[action.kind]
    other = stage + step
    if not 0 <= other <= last:
        raise ValueError(f"{action} on rank {rank} (virtual stage {stage}) has no peer: "
                         f"virtual stages run 0..{last}")
    other_rank, other_chunk = stage_coords(other, pipeline_size)
    return other_rank, Action(counterpart, other_chunk, action.microbatch)


def _receive(action: Action, rank: int, pipeline_size: int, num_chunks: int) -> list[Action]:
    """The receive `action` needs first: none on the first virtual stage for F (it reads the
    data) or on the last for B (it starts from the loss); W needs nothing."""
    stage = virtual_stage(rank, action.chunk, pipeline_size)
    if action.kind == F and stage > 0:
        return [Action(RECV_F, action.chunk, action.microbatch)]
    if action.kind == B and stage < pipeline_size * num_chunks - 1:
        return [Action(RECV_B, action.chunk, action.microbatch)]
    return []


def _send(action: Action, rank: int, pipeline_size: int, num_chunks: int) -> list[Action]:
    """The send of what `action` produced: none from the last virtual stage's F or the first
    virtual stage's B; W produces nothing to send."""
    stage = virtual_stage(rank, action.chunk, pipeline_size)
    if action.kind == F and stage < pipeline_size * num_chunks - 1:
        return [Action(SEND_F, action.chunk, action.microbatch)]
    if action.kind == B and stage > 0:
        return [Action(SEND_B, action.chunk, action.microbatch)]
    return []


def with_communication(compute: list[Action], rank: int, pipeline_size: int,
                       num_chunks: int) -> list[Action]:
    """Place transfers just in time: each receive right before the compute that consumes it,
    each send right after the compute that produced it (Megatron's non-interleaved 1F1B:
    send_forward_recv_backward between F and B, send_backward_recv_forward between B and F)."""
    actions = []
    for action in compute:
        actions += _receive(action, rank, pipeline_size, num_chunks)
        actions.append(action)
        actions += _send(action, rank, pipeline_size, num_chunks)
    return actions


def with_communication_between_steps(steps: list[list[Action]], rank: int, pipeline_size: int,
                                     num_chunks: int) -> list[Action]:
    """Place transfers as Megatron's interleaved schedule does: one batch between consecutive
    steps (a step is the F, the F and B, or the B of one schedule iteration) that sends all
    the finished step produced and receives all the next step needs. Sends leave one step
    later than just in time, which the interleaved warm-up's factor 2 accounts for; in
    exchange neighbouring ranks' batches pair up, so even waiting on whole batches, sends
    included, neither deadlocks nor adds idle time (placed just in time, interleaved 1F1B
    deadlocks under that stricter rule)."""

    def receives(step):
        return [r for a in step for r in _receive(a, rank, pipeline_size, num_chunks)]

    actions = receives(steps[0]) if steps else []
    for i, step in enumerate(steps):
        actions += step
        actions += [s for a in step for s in _send(a, rank, pipeline_size, num_chunks)]
        if i + 1 < len(steps):
            actions += receives(steps[i + 1])
    return actions


def with_aligned_leading_receives(steps: list[list[Action]], rank: int, pipeline_size: int, num_chunks: int,
                                  forwards: list[Action], backwards: list[Action]) -> list[Action]:
    """with_communication_between_steps, except on the rank that leads each direction of the
    ring (rank 0 for activations, rank p-1 for gradients), as Megatron's interleaved schedule
    places them (recv_tensor_from_previous_stage): there the batch after this rank's i-th
    forward (backward) receives what the rank at the other end produced with its (i-(p-1))-th,
    which it computed at the same time, and keeps it until the chunk that needs it runs. With
    micro-batch groups of p this is the next step's input; with larger groups N it arrives up to
    N - p steps early, and only so does every rank receive a peer's messages in the order the
    peer sent them (at p = 2 activations and gradients share one pair of ranks).

    `forwards` / `backwards`: every rank's forwards and backwards in schedule order (the same
    (chunk, micro-batch) order on every rank)."""
    p, v, last = pipeline_size, num_chunks, pipeline_size - 1
    index = {a: i for i, a in enumerate(forwards)} | {a: i for i, a in enumerate(backwards)}

    def aligned(action):
        """The leading rank's receive of what the far end sent while this rank ran `action`."""
        j = index[action] - (p - 1)
        if action.kind == F and rank == 0 and j >= 0 and forwards[j].chunk < v - 1:
            return [Action(RECV_F, forwards[j].chunk + 1, forwards[j].microbatch)]
        if action.kind == B and rank == last and j >= 0 and backwards[j].chunk > 0:
            return [Action(RECV_B, backwards[j].chunk - 1, backwards[j].microbatch)]
        return []

    def receives(done, following):
        out = []
        for kind, leading in ((F, rank == 0), (B, rank == last)):
            if leading:
                out += [r for a in done if a.kind == kind for r in aligned(a)]
            else:
                out += [r for a in following if a.kind == kind for r in _receive(a, rank, p, v)]
        return out

    actions = receives([], steps[0]) if steps else []
    for i, step in enumerate(steps):
        actions += step
        actions += [s for a in step for s in _send(a, rank, p, v)]
        if i + 1 < len(steps):
            actions += receives(step, steps[i + 1])
    return actions


def comm_batches(actions: list[Action]) -> list[list[Action]]:
    """Group a rank's list into the units an executor runs: each compute action alone, each
    maximal run of consecutive communication actions as one batch_isend_irecv batch."""
    groups: list[list[Action]] = []
    for action in actions:
        if action.is_comm and groups and groups[-1][0].is_comm:
            groups[-1].append(action)
        else:
            groups.append([action])
    return groups
