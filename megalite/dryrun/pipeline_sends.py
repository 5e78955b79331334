"""When a dry run's pipeline sends complete.

A real send holds its tensor until the transfer is done: the executor polls its sends before
every compute action and drops those whose works report completion (p2p.py). On NCCL a send's
work completes once the peer has posted the matching receive and the data has moved. The fake
process group's works never report completion, so without a model of the peer a dry run on
the fake CUDA device would hold every send to the end of the step (one activation message more
per micro-batch and chunk). `ScheduledSendsP2P` answers from the schedule instead: every
pipeline rank's action list is run through the schedule simulator (simulator.py, buffered
sends, backward twice a forward's time, three times with full recompute), and a send counts as
complete from max(its post, the peer's receive post) + one transfer on; the rank's k-th poll
happens at the simulated start of its k-th compute. (A dry run on the CPU device keeps the fake
works: gloo's send works report completion only when waited on, so a gloo run, too, holds its
sends to the end of the step.)
"""

from megalite.parallel.pipeline.actions import peer
from megalite.parallel.pipeline.p2p import PipelineP2P
from megalite.parallel.pipeline.schedules import schedule_actions
from megalite.parallel.pipeline.simulator import Costs, simulate

TRANSFER = 0.05
"""A message's time in forward-compute units (a hop on a fast link moves [s, b, h] in a few
percent of a layer stack's forward)."""


def send_completion_times(schedule: str, p: int, m: int, v: int, group_size, full_recompute: bool,
                          rank: int) -> tuple[dict, list]:
    """({send action: completion time}, [start time of each compute action]) of pipeline rank
    `rank`, in simulated time, the schedule's actions posted as listed (NCCL's order: the
    executor reorders transfers only for gloo)."""
    orders = [schedule_actions(schedule, p, r, m, v, group_size) for r in range(p)]
    report = simulate(orders, v, Costs(forward=1, backward=3 if full_recompute else 2, p2p_latency=TRANSFER))
    posted = [{a: start for a, start, _ in r.timeline if a.is_comm} for r in report.ranks]
    done = {}
    for action, start in posted[rank].items():
        if action.is_send:
            other, receive = peer(action, rank, p, v)
            done[action] = max(start, posted[other][receive]) + TRANSFER
    computes = [start for a, start, _ in report.ranks[rank].timeline if a.is_compute]
    return done, computes


class ScheduledSendsP2P(PipelineP2P):
    """PipelineP2P whose sends complete when the simulated schedule says the peer received them."""

    def __init__(self, p2p: PipelineP2P, done: dict, compute_starts: list):
        self.__dict__.update(p2p.__dict__)
        self._done, self._compute_starts, self._polls = done, compute_starts, 0
        self._posted_sends: list = []   # send actions in posting order, beside self._sends

    def post(self, actions, outgoing):
        received = super().post(actions, outgoing)
        sends = [a for a in actions if a.is_send]
        if len(self._sends) - len(self._posted_sends) != len(sends):
            raise RuntimeError("ScheduledSendsP2P expects one Work per send (the fake process group's)")
        self._posted_sends += sends
        return received

    def release_finished_sends(self) -> None:
        now = self._compute_starts[self._polls]
        self._polls += 1
        kept = [(s, a) for s, a in zip(self._sends, self._posted_sends) if self._done[a] > now]
        self._sends, self._posted_sends = [s for s, _ in kept], [a for _, a in kept]

    def wait_sends(self) -> None:
        super().wait_sends()
        self._posted_sends.clear()
