"""Pipeline schedules as data: for (pipeline size p, rank, micro-batches m, virtual stages v)
each schedule returns that rank's ordered list of `Action`s (see actions.py for the
vocabulary and the rule an executor follows to run it).

Every schedule is written first as the compute order of the diagram (warm-up forwards, steady
state one-forward-one-backward, cool-down backwards); the transfers are then placed around it:
just in time for the one-chunk schedules, between steps for interleaved 1F1B (as Megatron
does; see actions.py).

    none              p = 1 gradient accumulation:  F0 B0 F1 B1 ...
    gpipe             all forwards, then all backwards
    1f1b              PipeDream-flush / Megatron's non-interleaved schedule
    interleaved_1f1b  Megatron's interleaved schedule, v chunks per rank, micro-batches in
                      groups of N >= p per chunk (--microbatch-group-size-per-virtual-pipeline-stage)
    zb_h1             1F1B with the backward split into input-gradient B and weight-gradient W,
                      W deferred to fill the cool-down bubble (Qi et al. 2023, "ZB-H1")
"""

from collections import deque

from megalite.parallel.pipeline.actions import B, F, W, Action, with_aligned_leading_receives, with_communication

PIPELINE_FLAG = "--pipeline-model-parallel-size"
VIRTUAL_FLAG = "--num-virtual-stages-per-pipeline-rank"
SCHEDULE_FLAG = "--pipeline-schedule"
GROUP_FLAG = "--microbatch-group-size-per-virtual-pipeline-stage"
MICROBATCH_HINT = (
    "micro-batches per step (--global-batch-size / (--micro-batch-size x data-parallel size))")


def _one_forward_one_backward(forwards: list[Action], backwards: list[Action],
                              warmup: int) -> list[list[Action]]:
    """The 1F1B skeleton as steps: `warmup` forwards alone, then forward+backward pairs, then
    the remaining backwards alone. forwards[i] and backwards[i] are this rank's i-th of each."""
    steady = len(forwards) - warmup
    warmup_steps = [[f] for f in forwards[:warmup]]
    steady_steps = [[forwards[warmup + i], backwards[i]] for i in range(steady)]
    cooldown_steps = [[b] for b in backwards[steady:]]
    return warmup_steps + steady_steps + cooldown_steps


def _flatten(steps: list[list[Action]]) -> list[Action]:
    return [action for step in steps for action in step]


def no_pipelining(pipeline_size: int, rank: int, num_microbatches: int,
                  num_chunks: int = 1) -> list[Action]:
    """Plain gradient accumulation on a single stage: F0 B0 F1 B1 ..."""
    order = []
    for k in range(num_microbatches):
        order += [Action(F, 0, k), Action(B, 0, k)]
    return order


def gpipe(pipeline_size: int, rank: int, num_microbatches: int,
          num_chunks: int = 1) -> list[Action]:
    """All m forwards, then all m backwards (in micro-batch order). Holds m activations."""
    order = [Action(F, 0, k) for k in range(num_microbatches)]
    order += [Action(B, 0, k) for k in range(num_microbatches)]
    return with_communication(order, rank, pipeline_size, 1)


def one_f_one_b(pipeline_size: int, rank: int, num_microbatches: int,
                num_chunks: int = 1) -> list[Action]:
    """1F1B: min(p - rank - 1, m) warm-up forwards, then one forward one backward, then the
    cool-down backwards. Rank r never holds more than p - r micro-batches."""
    m = num_microbatches
    warmup = min(pipeline_size - rank - 1, m)
    forwards = [Action(F, 0, k) for k in range(m)]
    backwards = [Action(B, 0, k) for k in range(m)]
    steps = _one_forward_one_backward(forwards, backwards, warmup)
    return with_communication(_flatten(steps), rank, pipeline_size, 1)


def interleaved_order(num_microbatches: int, num_chunks: int, group_size: int) -> list[tuple[int, int]]:
    """(micro-batch, chunk) of a rank's forwards in Megatron's interleaved order (its
    get_schedule_table): micro-batches go through the chunks in groups of `group_size` (N,
    --microbatch-group-size-per-virtual-pipeline-stage, default p): mb 0..N-1 on chunk 0, the
    same N on chunk 1, ..., chunk v-1, then mb N..2N-1 on chunk 0, and so on; the last group
    holds what remains. Backwards follow the same order with the chunks reversed (the last
    chunk's backward comes first)."""
    order = []
    for start in range(0, num_microbatches, group_size):
        end = min(start + group_size, num_microbatches)
        order += [(k, c) for c in range(num_chunks) for k in range(start, end)]
    return order


def interleaved_1f1b(pipeline_size: int, rank: int, num_microbatches: int,
                     num_chunks: int, group_size: int | None = None) -> list[Action]:
    """Megatron's interleaved 1F1B over v chunks with micro-batch groups of N (default p):
    warm-up (p - rank - 1)*2 + (v - 1)*N forwards (capped at m*v), then 1F1B over the m*v
    chunk-micro-batches, then cool-down. One transfer batch between steps; rank 0 peaks at
    (v - 1)*N + 2p - 1 chunk-activations."""
    p, v, n = pipeline_size, num_chunks, group_size or pipeline_size
    total = num_microbatches * v
    warmup = min((p - rank - 1) * 2 + (v - 1) * n, total)
    order = interleaved_order(num_microbatches, v, n)
    forwards = [Action(F, c, k) for k, c in order]
    backwards = [Action(B, v - 1 - c, k) for k, c in order]
    steps = _one_forward_one_backward(forwards, backwards, warmup)
    return with_aligned_leading_receives(steps, rank, p, v, forwards, backwards)


def zb_h1(pipeline_size: int, rank: int, num_microbatches: int,
          num_chunks: int = 1) -> list[Action]:
    """ZB-H1: 1F1B whose backward is split into B (input gradient, on the critical path) and
    W (weight gradient, deferred).

    Rank r keeps up to r weight-gradients pending during the steady state, so a micro-batch
    stays held from F until W for at most (p - r) + r = p micro-batches: the same peak as
    1F1B's first stage. In the cool-down each B is followed by the oldest pending W, and the
    W's still pending at the end run last, filling the bubble 1F1B leaves there.
    """
    m = num_microbatches
    warmup = min(pipeline_size - rank - 1, m)
    steady = m - warmup
    pending: deque[int] = deque()
    order = [Action(F, 0, k) for k in range(warmup)]                 # warm-up
    for i in range(steady):                                          # steady state
        order += [Action(F, 0, warmup + i), Action(B, 0, i)]
        pending.append(i)
        if len(pending) > rank:
            order.append(Action(W, 0, pending.popleft()))
    for i in range(steady, m):                                       # cool-down
        order.append(Action(B, 0, i))
        pending.append(i)
        order.append(Action(W, 0, pending.popleft()))
    order += [Action(W, 0, k) for k in pending]                      # drain
    return with_communication(order, rank, pipeline_size, 1)


SCHEDULES = {
    "none": no_pipelining,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved_1f1b": interleaved_1f1b,
    "zb_h1": zb_h1,
}


def default_schedule(pipeline_size: int, num_chunks: int = 1) -> str:
    """What Megatron would run: no pipelining at p = 1, interleaved 1F1B with v > 1 chunks,
    else 1F1B."""
    if pipeline_size == 1:
        return "none"
    return "interleaved_1f1b" if num_chunks > 1 else "1f1b"


def validate_schedule(name: str, pipeline_size: int, num_microbatches: int,
                      num_chunks: int = 1, group_size: int | None = None) -> None:
    """Refuse, with a one-line ValueError naming the flags, a schedule that cannot run this
    configuration (`group_size`: --microbatch-group-size-per-virtual-pipeline-stage). Meant to
    run before any process starts."""
    p, m, v = pipeline_size, num_microbatches, num_chunks
    if group_size is not None and name != "interleaved_1f1b":
        raise ValueError(f"{GROUP_FLAG} {group_size} applies to the interleaved schedule only ({SCHEDULE_FLAG} "
                         f"{name})")
    if name not in SCHEDULES:
        raise ValueError(f"{SCHEDULE_FLAG} {name!r} is unknown; expected one of "
                         f"{sorted(SCHEDULES)}")
    for flag, value in ((PIPELINE_FLAG, p), (VIRTUAL_FLAG, v), (MICROBATCH_HINT, m)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{flag} must be a positive integer, got {value!r}")
    if name == "none" and p > 1:
        raise ValueError(f"{SCHEDULE_FLAG} none runs a single stage but {PIPELINE_FLAG} is {p}; "
                         f"use {default_schedule(p, v)}")
    if name == "interleaved_1f1b":
        if p < 2 or v < 2:
            raise ValueError(f"{SCHEDULE_FLAG} interleaved_1f1b needs {PIPELINE_FLAG} >= 2 and "
                             f"{VIRTUAL_FLAG} >= 2, got {p} and {v}")
        if group_size is None and m % p:
            raise ValueError(f"{SCHEDULE_FLAG} interleaved_1f1b runs micro-batches in groups of "
                             f"{PIPELINE_FLAG} {p}, so the number of {MICROBATCH_HINT} must be a "
                             f"multiple of {p}, got {m}")
        if group_size is not None and not p <= group_size <= m:
            raise ValueError(f"{GROUP_FLAG} {group_size} must lie between {PIPELINE_FLAG} {p} and the "
                             f"{MICROBATCH_HINT}, {m}")
        if group_size is not None and 0 < m % group_size < p:
            raise ValueError(f"{GROUP_FLAG} {group_size}: the last group would hold {m % group_size} of the {m} "
                             f"{MICROBATCH_HINT}, fewer than {PIPELINE_FLAG} {p} (as Megatron, megalite "
                             "refuses the bubbles that would leave)")
    elif v > 1:
        raise ValueError(f"{SCHEDULE_FLAG} {name} runs one chunk per rank but {VIRTUAL_FLAG} is "
                         f"{v}; use interleaved_1f1b")


def schedule_actions(name: str, pipeline_size: int, rank: int, num_microbatches: int,
                     num_chunks: int = 1, group_size: int | None = None) -> list[Action]:
    """The ordered actions of `rank` under schedule `name` (a --pipeline-schedule value);
    `group_size`: the interleaved schedule's micro-batch groups (None: p)."""
    validate_schedule(name, pipeline_size, num_microbatches, num_chunks, group_size)
    if not 0 <= rank < pipeline_size:
        raise ValueError(f"pipeline rank {rank} outside 0..{pipeline_size - 1}")
    if group_size is not None:
        return interleaved_1f1b(pipeline_size, rank, num_microbatches, num_chunks, group_size)
    return SCHEDULES[name](pipeline_size, rank, num_microbatches, num_chunks)


def all_ranks(name: str, pipeline_size: int, num_microbatches: int,
              num_chunks: int = 1, group_size: int | None = None) -> list[list[Action]]:
    """schedule_actions for every rank of the pipeline, indexed by rank."""
    return [schedule_actions(name, pipeline_size, r, num_microbatches, num_chunks, group_size)
            for r in range(pipeline_size)]
