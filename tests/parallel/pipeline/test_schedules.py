"""Pipeline schedules as pure data: completeness, dependencies, deadlock freedom, and the
bubble and memory formulas of shared/docs/formulas.md, all without processes.

Unit convention: a rank's whole share of the model costs 1 forward and 1 backward, so with
one chunk per rank F = B = 1 and with v chunks each chunk's F and B cost 1/v. The ideal time
of a rank is its busy time, m*(F+B) (times v chunks at 1/v each for interleaved); idle time is
the makespan (latest finish over all ranks) minus it. Costs are Fractions, so the formulas
are checked exactly. For ZB-H1, F = B = W = 1 and the unsplit backward of 1F1B costs B+W = 2.
"""

from fractions import Fraction

import pytest

from megalite.parallel.pipeline.actions import (B, F, RECV_B, RECV_F, SEND_B, SEND_F, W, Action,
                                                comm_batches)
from megalite.parallel.pipeline.schedules import (SCHEDULES, all_ranks, default_schedule,
                                                  interleaved_order, schedule_actions,
                                                  validate_schedule)
from megalite.parallel.pipeline.simulator import (Costs, DeadlockError, ScheduleError, held_activations,
                                                  simulate)


def GROUPS(p, m):
    """--microbatch-group-size-per-virtual-pipeline-stage values Megatron accepts for p, m:
    p <= N <= m, the last group empty or holding at least p."""
    return [n for n in range(p, m + 1) if m % n == 0 or m % n >= p]


def _cases():
    cases = [("none", 1, 1, m) for m in (1, 3, 5)]
    for p in (2, 4, 8):
        for m in sorted({1, 3, 5, p, 2 * p, 3 * p}):
            cases += [(name, p, 1, m) for name in ("gpipe", "1f1b", "zb_h1")]
        for v in (2, 4):
            cases += [("interleaved_1f1b", p, v, m) for m in (p, 2 * p, 3 * p)]
    return cases


CASES = _cases()
# Interleaved 1F1B with micro-batch groups N other than p: (p, v, m, N)
GROUP_CASES = [(p, v, m, n) for p in (2, 4) for v in (2, 3) for m in (p + 1, 2 * p, 2 * p + 1, 3 * p)
               for n in GROUPS(p, m) if n != p]


def _costs(name, v):
    if name == "zb_h1":
        return Costs(forward=1, backward=1, weight=1)
    return Costs(forward=Fraction(1, v), backward=Fraction(1, v))


def _check_complete(name, lists, p, v, m):
    """Every (micro-batch, virtual stage) has exactly one F and one B (and one W for ZB-H1),
    each non-boundary input is received once before its compute and each output sent once
    after it, and nothing else appears."""
    last = p * v - 1
    for rank, actions in enumerate(lists):
        position = {}
        for i, action in enumerate(actions):
            assert action not in position, f"rank {rank}: {action} appears twice"
            assert 0 <= action.chunk < v and 0 <= action.microbatch < m, f"rank {rank}: {action}"
            position[action] = i
        for c in range(v):
            stage = c * p + rank
            for k in range(m):
                at = {kind: position.get(Action(kind, c, k))
                      for kind in (F, B, W, SEND_F, RECV_F, SEND_B, RECV_B)}
                assert at[F] is not None and at[B] is not None, f"rank {rank} c{c} mb{k}: {at}"
                assert at[F] < at[B]
                assert (at[W] is not None) == (name == "zb_h1"), f"rank {rank} c{c} mb{k}: W"
                if at[W] is not None:
                    assert at[B] < at[W]
                assert (at[RECV_F] is not None) == (stage > 0)
                assert (at[SEND_F] is not None) == (stage < last)
                assert (at[RECV_B] is not None) == (stage < last)
                assert (at[SEND_B] is not None) == (stage > 0)
                if stage > 0:
                    assert at[RECV_F] < at[F] < at[SEND_B] and at[B] < at[SEND_B]
                if stage < last:
                    assert at[F] < at[SEND_F] and at[RECV_B] < at[B]
        assert len(actions) == len(position)


def _check_dependencies(report, p, v, m):
    """From simulated times: F of stage s+1 after F of s; B of s after B of s+1 and after its
    own F; W after its B."""
    span = {}
    for rank, rank_report in enumerate(report.ranks):
        for action, start, end in rank_report.timeline:
            if action.is_compute:
                span[(action.kind, action.chunk * p + rank, action.microbatch)] = (start, end)
    for s in range(p * v):
        for k in range(m):
            f_start, f_end = span[(F, s, k)]
            b_start, b_end = span[(B, s, k)]
            assert b_start >= f_end, (s, k)
            if s > 0:
                assert f_start >= span[(F, s - 1, k)][1], (s, k)
            if s < p * v - 1:
                assert b_start >= span[(B, s + 1, k)][1], (s, k)
            if (W, s, k) in span:
                assert span[(W, s, k)][0] >= b_end, (s, k)


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_schedule_is_complete_ordered_and_deadlock_free(name, p, v, m):
    lists = all_ranks(name, p, m, v)
    _check_complete(name, lists, p, v, m)
    for rendezvous in (False, True):
        report = simulate(lists, v, _costs(name, v), rendezvous=rendezvous)
        _check_dependencies(report, p, v, m)
        assert [r.peak_held for r in report.ranks] == [held_activations(a) for a in lists]


@pytest.mark.parametrize("p,v,m,n", GROUP_CASES)
def test_grouped_interleaving_is_complete_ordered_and_deadlock_free(p, v, m, n):
    """Groups of N micro-batches per chunk: still every action once, in dependency order,
    deadlock-free under both transfer rules; rank 0 holds its warm-up + 1 =
    2(p - 1) + (v - 1)N + 1 chunk-activations (capped at all m*v)."""
    lists = all_ranks("interleaved_1f1b", p, m, v, n)
    _check_complete("interleaved_1f1b", lists, p, v, m)
    for rendezvous in (False, True):
        report = simulate(lists, v, _costs("interleaved_1f1b", v), rendezvous=rendezvous)
        _check_dependencies(report, p, v, m)
        assert [r.peak_held for r in report.ranks] == [held_activations(a) for a in lists]
    assert held_activations(lists[0]) == min(2 * (p - 1) + (v - 1) * n + 1, m * v)


@pytest.mark.parametrize("name,p,v,m", [c for c in CASES if c[0] != "zb_h1"])
def test_bubble_matches_formula(name, p, v, m):
    """GPipe and 1F1B idle (p-1)/m of ideal time on every rank, interleaved (p-1)/(v*m),
    no pipelining 0 -- both when sends are buffered and when they wait for the receiver."""
    lists = all_ranks(name, p, m, v)
    for rendezvous in (False, True):
        report = simulate(lists, v, _costs(name, v), rendezvous=rendezvous)
        for rank_report in report.ranks:
            assert rank_report.busy == 2 * m
            assert rank_report.bubble_fraction() == Fraction(p - 1, v * m)


@pytest.mark.parametrize("name,p,v,m", CASES)
def test_peak_held_activations(name, p, v, m):
    peaks = [held_activations(actions) for actions in all_ranks(name, p, m, v)]
    if name in ("none", "gpipe"):
        assert peaks == [m if name == "gpipe" else 1] * p
    elif name == "1f1b":
        # Stage 0 holds at most p, exactly p once m >= p; rank r holds p - r.
        assert peaks == [min(p - r, m) for r in range(p)]
    elif name == "zb_h1":
        # Held until W: rank r keeps p - r forwards plus r deferred W's, i.e. p on every rank.
        assert peaks == [min(p, m)] * p
    else:
        # Stage 0 holds warm-up + 1 = p*v + p - 1 chunk-activations (each 1/v of the rank's
        # layers), i.e. p * (1 + (p-1)/(p*v)) micro-batches' worth; with m = p the warm-up
        # covers every chunk-micro-batch and the peak is all m*v of them.
        assert peaks[0] == min(p * v + p - 1, m * v)
        if m >= 2 * p:
            assert Fraction(peaks[0], v) == p * (1 + Fraction(p - 1, p * v))


@pytest.mark.parametrize("p,m", [(p, m) for p in (2, 4, 8)
                                 for m in sorted({1, 3, 5, p, 2 * p, 3 * p})])
def test_zb_h1_idles_less_than_1f1b_at_equal_peak_memory(p, m):
    costs = Costs(forward=1, backward=1, weight=1)          # 1F1B's unsplit B costs 2
    zb_lists, ob_lists = all_ranks("zb_h1", p, m), all_ranks("1f1b", p, m)
    zb, ob = simulate(zb_lists, 1, costs), simulate(ob_lists, 1, costs)
    assert max(map(held_activations, zb_lists)) == max(map(held_activations, ob_lists)) == min(p, m)
    assert held_activations(zb_lists[0]) == held_activations(ob_lists[0])
    for zb_rank, ob_rank in zip(zb.ranks, ob.ranks):
        assert zb_rank.busy == ob_rank.busy == 3 * m
        assert zb_rank.idle < ob_rank.idle
        assert ob_rank.idle == 3 * (p - 1)
        if m >= p:
            # ZB-H1's bubble (p-1)(F+B-W): a third of 1F1B's (p-1)(F+B+W).
            assert zb_rank.idle == p - 1 == ob_rank.idle / 3


def test_one_f_one_b_reads_like_the_diagram():
    compute = [str(a) for a in schedule_actions("1f1b", 4, 1, 5) if a.is_compute]
    assert compute == ["F(c0,mb0)", "F(c0,mb1)",                                   # warm-up 2
                       "F(c0,mb2)", "B(c0,mb0)", "F(c0,mb3)", "B(c0,mb1)", "F(c0,mb4)", "B(c0,mb2)",
                       "B(c0,mb3)", "B(c0,mb4)"]                                   # cool-down
    assert [str(a) for a in schedule_actions("none", 1, 0, 2)] == ["F(c0,mb0)", "B(c0,mb0)",
                                                                    "F(c0,mb1)", "B(c0,mb1)"]
    # Megatron's combined calls: send_forward_recv_backward, send_backward_recv_forward.
    batches = [[str(a) for a in batch] for batch in comm_batches(schedule_actions("1f1b", 2, 0, 3))
               if batch[0].is_comm]
    assert batches[:2] == [["SEND_F(c0,mb0)"], ["SEND_F(c0,mb1)", "RECV_B(c0,mb0)"]]


def test_zb_h1_defers_weight_gradients_into_the_cool_down():
    compute = [str(a) for a in schedule_actions("zb_h1", 4, 3, 6) if a.is_compute]
    # The last rank keeps 3 W's pending, then one W per step, and drains at the end.
    assert compute[:8] == ["F(c0,mb0)", "B(c0,mb0)", "F(c0,mb1)", "B(c0,mb1)", "F(c0,mb2)",
                           "B(c0,mb2)", "F(c0,mb3)", "B(c0,mb3)"]
    assert compute[8] == "W(c0,mb0)" and compute[-3:] == ["W(c0,mb3)", "W(c0,mb4)", "W(c0,mb5)"]


def test_interleaved_order_matches_megatron_core():
    """Oracle: megatron-core's schedule table and warm-up count give the same compute order."""
    schedules = pytest.importorskip("megatron.core.pipeline_parallel.schedules")

    class Group:
        def __init__(self, size, rank):
            self.size, self.rank = (lambda: size), (lambda: rank)

    class Communicator:
        def __init__(self, size, rank, v):
            self.pp_group, self.virtual_pipeline_model_parallel_size = Group(size, rank), v

    for p in (2, 4, 8):
        for v in (None, 2, 4):
            chunks = v or 1
            for m in (p, 2 * p, 3 * p, 2 * p + 1):
                for n in ([None] if v is None else [None, *GROUPS(p, m)]):
                    if (v is None or n is None) and m % p:
                        continue
                    table = schedules.get_schedule_table(m, chunks, n or p)
                    for rank in range(p):
                        total, _, warmup, _ = schedules.get_pp_rank_microbatches(
                            m, chunks, n or p, p2p_communicator=Communicator(p, rank, v))
                        fwd = [Action(F, c, k) for k, c in table]
                        bwd = [Action(B, chunks - 1 - c, k) for k, c in table]
                        expected = fwd[:warmup]
                        for i in range(total - warmup):
                            expected += [fwd[warmup + i], bwd[i]]
                        expected += bwd[total - warmup:]
                        name = "interleaved_1f1b" if v else "1f1b"
                        got = [a for a in schedule_actions(name, p, rank, m, chunks, n) if a.is_compute]
                        assert got == expected, (p, v, m, n, rank)


def test_interleaved_order_groups_micro_batches():
    # p=2, v=2: mb 0,1 on chunk 0, then mb 0,1 on chunk 1, then mb 2,3 on chunk 0 ...
    assert interleaved_order(4, 2, 2) == [(0, 0), (1, 0), (0, 1), (1, 1), (2, 0), (3, 0), (2, 1), (3, 1)]
    # Megatron's documented example, PP=2 VP=2 with groups of 3 and 5 micro-batches:
    # rank 0 | 0 1 2 0 1 2 3 4 3 4 (the last group holds the 2 that remain)
    assert interleaved_order(5, 2, 3) == [(0, 0), (1, 0), (2, 0), (0, 1), (1, 1), (2, 1),
                                          (3, 0), (4, 0), (3, 1), (4, 1)]
    compute = [a for a in schedule_actions("interleaved_1f1b", 2, 0, 5, 2, 3) if a.is_compute]
    # warm-up (2 - 0 - 1)*2 + (2 - 1)*3 = 5 forwards, then one forward one backward
    assert compute[:7] == [Action(F, 0, 0), Action(F, 0, 1), Action(F, 0, 2), Action(F, 1, 0), Action(F, 1, 1),
                           Action(F, 1, 2), Action(B, 1, 0)]


def test_registry_and_default():
    assert set(SCHEDULES) == {"none", "gpipe", "1f1b", "interleaved_1f1b", "zb_h1"}
    assert default_schedule(1) == "none"
    assert default_schedule(4) == "1f1b"
    assert default_schedule(4, 2) == "interleaved_1f1b"


@pytest.mark.parametrize("args,match", [
    (("interleaved_1f1b", 4, 6, 2), r"multiple of 4, got 6"),
    (("interleaved_1f1b", 4, 2, 2), r"multiple of 4, got 2"),
    (("interleaved_1f1b", 4, 8, 1), r"--num-virtual-stages-per-pipeline-rank >= 2"),
    (("1f1b", 4, 8, 2), r"--pipeline-schedule 1f1b runs one chunk per rank"),
    (("gpipe", 2, 4, 2), r"use interleaved_1f1b"),
    (("none", 2, 4, 1), r"--pipeline-schedule none runs a single stage"),
    (("looped_bfs", 2, 4, 1), r"--pipeline-schedule 'looped_bfs' is unknown"),
    (("interleaved_1f1b", 4, 8, 2, 3), r"group-size-per-virtual-pipeline-stage 3 must lie between .* 4 and .* 8"),
    (("interleaved_1f1b", 4, 8, 2, 9), r"group-size-per-virtual-pipeline-stage 9 must lie between"),
    (("interleaved_1f1b", 4, 9, 2, 4), r"the last group would hold 1 of the 9"),
    (("1f1b", 4, 8, 1, 4), r"group-size-per-virtual-pipeline-stage 4 applies to the interleaved schedule only"),
    (("1f1b", 2, 0, 1), r"micro-batches per step .* must be a positive integer"),
])
def test_validation_names_the_flags(args, match):
    with pytest.raises(ValueError, match=match):
        validate_schedule(*args)
    with pytest.raises(ValueError, match=match):
        schedule_actions(args[0], args[1], 0, *args[2:])


def test_simulator_reports_deadlock_with_ranks_and_actions():
    # Both ranks wait to receive before either sends.
    lists = [[Action(RECV_B, 0, 0), Action(F, 0, 0), Action(SEND_F, 0, 0)],
             [Action(RECV_F, 0, 0), Action(F, 0, 0), Action(SEND_B, 0, 0)]]
    with pytest.raises(DeadlockError, match=r"rank 0 waits in batch \[RECV_B\(c0,mb0\)\] "
                                            r"\(action #0\) for RECV_B\(c0,mb0\) <- rank 1; rank 1"):
        simulate(lists)


def test_simulator_rejects_out_of_order_transfers():
    lists = [[Action(F, 0, 0), Action(F, 0, 1), Action(SEND_F, 0, 0), Action(SEND_F, 0, 1)],
             [Action(RECV_F, 0, 1), Action(RECV_F, 0, 0), Action(F, 0, 0), Action(F, 0, 1)]]
    with pytest.raises(ScheduleError, match=r"transfer #0 from rank 0 to rank 1 does not match"):
        simulate(lists)


def test_simulator_rendezvous_send_waits_for_the_receiver():
    # Rank 1 computes 3 units before posting its receive.
    lists = [[Action(F, 0, 0), Action(SEND_F, 0, 0), Action(F, 0, 1)],
             [Action(F, 0, 5), Action(F, 0, 6), Action(F, 0, 7), Action(RECV_F, 0, 0)]]
    buffered = simulate(lists, costs=Costs(backward=0))
    strict = simulate(lists, costs=Costs(backward=0), rendezvous=True)
    assert buffered.ranks[0].finish == 2 and strict.ranks[0].finish == 4


def test_simulator_p2p_latency():
    # p=2, m=1, one transfer each way: F0, latency, F1, B1, latency, B0.
    report = simulate(all_ranks("1f1b", 2, 1), costs=Costs(p2p_latency=Fraction(1, 2)))
    assert report.makespan == 5
    assert [r.busy for r in report.ranks] == [2, 2]
    assert [r.idle for r in report.ranks] == [3, 3]


def test_simulator_costs_per_rank_and_chunk():
    # p=2, m=1: rank 0's F and B cost 1, rank 1's (a heavier last stage) 2, its messages take
    # 1/2: F0 [0,1], transfer, F1 [1.5,3.5], B1 [3.5,5.5], transfer, B0 [6,7].
    light, heavy = Costs(1, 1, 0, Fraction(1, 2)), Costs(2, 2, 0, Fraction(1, 2))
    report = simulate(all_ranks("1f1b", 2, 1), costs=[[light], [heavy]])
    assert report.makespan == 7
    assert [r.busy for r in report.ranks] == [2, 4]
    # interleaved: only the last chunk of the last rank is heavier; the table is rank x chunk
    lists = all_ranks("interleaved_1f1b", 2, 2, 2)
    uniform = simulate(lists, 2, Costs(1, 1)).makespan
    tail = simulate(lists, 2, [[Costs(1, 1), Costs(1, 1)], [Costs(1, 1), Costs(3, 3)]]).makespan
    assert (uniform, tail) == (10, 18)  # two micro-batches' F and B on the heavy chunk, 4 more each
    with pytest.raises(ValueError, match="2 ranks x 2 chunks"):
        simulate(lists, 2, [[Costs()], [Costs()]])


def test_held_activations_counts_until_weight_gradient():
    split = [Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0), Action(F, 0, 2), Action(W, 0, 0)]
    fused = [Action(F, 0, 0), Action(F, 0, 1), Action(B, 0, 0), Action(F, 0, 2)]
    assert held_activations(split) == 3 and held_activations(fused) == 2
