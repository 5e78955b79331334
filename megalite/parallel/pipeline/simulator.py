"""Run every pipeline rank's action list against a cost model: idle time, memory, deadlocks.

Time model. All ranks start at time 0. A compute action occupies its rank for its cost
(`Costs`: one for every rank and chunk, or a table `costs[rank][chunk]` where stages differ,
as a first stage with the embedding or a last one with the output layer do): F costs
`forward`, W costs `weight`, B costs `backward` when the schedule splits
the backward (a W exists for the same chunk and micro-batch on that rank) and
`backward + weight` when it does not, so split and unsplit schedules are compared at equal
total work. Communication follows the executor rule of actions.py: each maximal run
of consecutive communication actions is posted as one batch when the rank reaches it, and the
rank resumes when every operation of the batch has completed. A message takes the
`p2p_latency` of its sender's chunk. Messages between two ranks are
matched in order (the i-th send from a to b is the i-th receive at b from a, as NCCL and gloo
do); a mismatch raises. Two send semantics:

    buffered (default)  a send completes when posted; a receive completes at
                        max(its post time, send post time + p2p latency)
    rendezvous=True     both ends complete at max(send post, receive post) + p2p latency,
                        i.e. a send also waits for the peer to post its receive (what a
                        batch_isend_irecv whose send requests are waited on needs)

Reported per rank: `busy` (sum of compute costs), `finish` (end of its last action), `idle`
= makespan - busy, where the makespan is the latest finish over all ranks (the optimizer step
waits for every rank), and `peak_held`.

Memory model. A (chunk, micro-batch) activation is held on its rank from the start of its F
until the end of its B, or until the end of its W when the backward is split (W needs the
layer inputs kept for the weight gradients; we count the whole activation as held, which is
the conservative reading). `peak_held` is the largest number held at once, in
chunk-activations: with one chunk per rank that is micro-batches; with v chunks each is 1/v
of a rank's layers, so the peak in micro-batch equivalents is peak_held / v.
"""

from dataclasses import dataclass, field

from megalite.parallel.pipeline.actions import B, F, W, Action, comm_batches, peer


class DeadlockError(RuntimeError):
    """The ranks' action lists can make no further progress."""


class ScheduleError(ValueError):
    """An action list that no executor could run (mismatched transfers, bad peers)."""


@dataclass(frozen=True)
class Costs:
    """Unit costs. `backward` is the input-gradient part, `weight` the weight-gradient part;
    an unsplit B costs both. Use fractions.Fraction for exact arithmetic."""

    forward: object = 1
    backward: object = 1
    weight: object = 0
    p2p_latency: object = 0


@dataclass
class RankReport:
    busy: object = 0
    finish: object = 0
    idle: object = 0
    peak_held: int = 0
    # (action, start, end) for every action in list order; comm actions carry the post time
    # of their batch as start and the batch's completion as end.
    timeline: list = field(default_factory=list)

    def bubble_fraction(self):
        """idle / busy: the fraction of the ideal (busy) time spent waiting."""
        return self.idle / self.busy


@dataclass
class SimulationReport:
    makespan: object
    ranks: list


def held_activations(actions: list[Action]) -> int:
    """Peak number of (chunk, micro-batch) activations held on a rank (see module docstring);
    depends only on the order of the rank's compute actions."""
    split = {(a.chunk, a.microbatch) for a in actions if a.kind == W}
    held, peak = set(), 0
    for a in actions:
        key = (a.chunk, a.microbatch)
        if a.kind == F:
            held.add(key)
            peak = max(peak, len(held))
        elif (a.kind == B and key not in split) or a.kind == W:
            held.discard(key)
    return peak


class _Channel:
    """Messages from one rank to another, matched in posting order."""

    def __init__(self):
        self.sends: list[tuple[Action, Action, object]] = []   # (send, expected recv, post time)
        self.recvs: list[tuple[Action, object]] = []           # (recv, post time)


def _cost(action: Action, split: set, costs: Costs):
    """The time `action` occupies its rank (`costs` already that rank's and chunk's)."""
    if action.kind == F:
        return costs.forward
    if action.kind == W:
        return costs.weight
    if (action.chunk, action.microbatch) in split:
        return costs.backward
    return costs.backward + costs.weight


def _cost_table(costs, p: int, num_chunks: int) -> list[list[Costs]]:
    """costs[rank][chunk] from one Costs or a table of them, checked for shape."""
    if isinstance(costs, Costs):
        return [[costs] * num_chunks for _ in range(p)]
    table = [list(row) for row in costs]
    if len(table) != p or any(len(row) != num_chunks for row in table):
        raise ValueError(f"costs table must be {p} ranks x {num_chunks} chunks, got "
                         f"{len(table)} x {sorted({len(row) for row in table})}")
    return table


def simulate(actions_per_rank: list[list[Action]], num_chunks: int | None = None,
             costs: Costs | list[list[Costs]] = Costs(), rendezvous: bool = False) -> SimulationReport:
    """Run all ranks' action lists together (index = pipeline rank) and report timing and
    memory; raises DeadlockError naming the stuck ranks and actions, ScheduleError for
    transfers that do not match. `costs` is one Costs for every rank and chunk or a table
    costs[rank][chunk]."""
    p = len(actions_per_rank)
    if num_chunks is None:
        num_chunks = 1 + max((a.chunk for acts in actions_per_rank for a in acts), default=0)
    table = _cost_table(costs, p, num_chunks)
    groups = [comm_batches(acts) for acts in actions_per_rank]
    splits = [{(a.chunk, a.microbatch) for a in acts if a.kind == W} for acts in actions_per_rank]
    channels = {(a, b): _Channel() for a in range(p) for b in range(p)}
    reports = [RankReport() for _ in range(p)]
    clock = [0] * p
    position = [0] * p
    posted: list[tuple | None] = [None] * p   # per rank: (post time, ops) of the batch it waits in

    def post(rank, batch):
        ops = []  # (channel, index in it, is_send, src, dst, action)
        for action in batch:
            other, expected = peer(action, rank, p, num_chunks)
            if action.is_send:
                channel = channels[(rank, other)]
                channel.sends.append((action, expected, clock[rank]))
                ops.append((channel, len(channel.sends) - 1, True, rank, other, action))
            else:
                channel = channels[(other, rank)]
                channel.recvs.append((action, clock[rank]))
                ops.append((channel, len(channel.recvs) - 1, False, other, rank, action))
        return ops

    def completion(op):
        channel, index, is_send, src, dst, _ = op
        if index >= len(channel.sends) or index >= len(channel.recvs):
            if is_send and not rendezvous:
                return channel.sends[index][2]
            return None
        send, expected, send_time = channel.sends[index]
        recv, recv_time = channel.recvs[index]
        if recv != expected:
            raise ScheduleError(
                f"transfer #{index} from rank {src} to rank {dst} does not match: rank {src} "
                f"sends for {send}, which rank {dst} must receive as {expected}, but rank {dst}'s "
                f"#{index} receive from rank {src} is {recv}")
        latency = table[src][send.chunk].p2p_latency
        if rendezvous:
            return max(send_time, recv_time) + latency
        if is_send:
            return send_time
        return max(recv_time, send_time + latency)

    def advance(rank) -> bool:
        moved = False
        while position[rank] < len(groups[rank]):
            batch = groups[rank][position[rank]]
            if batch[0].is_compute:
                action = batch[0]
                cost = _cost(action, splits[rank], table[rank][action.chunk])
                reports[rank].timeline.append((action, clock[rank], clock[rank] + cost))
                reports[rank].busy += cost
                clock[rank] += cost
            else:
                if posted[rank] is None:
                    posted[rank] = (clock[rank], post(rank, batch))
                    moved = True
                start, ops = posted[rank]
                done = [completion(op) for op in ops]
                if any(t is None for t in done):
                    return moved
                clock[rank] = max([clock[rank]] + done)
                reports[rank].timeline += [(a, start, clock[rank]) for a in batch]
                posted[rank] = None
            position[rank] += 1
            moved = True
        return moved

    while any([advance(rank) for rank in range(p)]):
        pass

    stuck = [r for r in range(p) if position[r] < len(groups[r])]
    if stuck:
        def waiting_for(rank):
            return ", ".join(f"{op[5]} {'->' if op[2] else '<-'} rank {op[4] if op[2] else op[3]}"
                             for op in posted[rank][1] if completion(op) is None)

        raise DeadlockError("pipeline schedule deadlocks: " + "; ".join(
            f"rank {r} waits in batch [{', '.join(map(str, groups[r][position[r]]))}] "
            f"(action #{sum(len(g) for g in groups[r][:position[r]])}) for {waiting_for(r)}"
            for r in stuck))
    for channel_key, channel in channels.items():
        if len(channel.sends) != len(channel.recvs):
            raise ScheduleError(f"rank {channel_key[0]} sends {len(channel.sends)} messages to "
                                f"rank {channel_key[1]}, which receives {len(channel.recvs)}")

    makespan = max(clock, default=0)
    for rank, report in enumerate(reports):
        report.finish = clock[rank]
        report.idle = makespan - report.busy
        report.peak_held = held_activations(actions_per_rank[rank])
    return SimulationReport(makespan=makespan, ranks=reports)
