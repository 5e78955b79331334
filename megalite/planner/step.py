"""One training step of a layout: every pipeline rank's micro-batch times (compute.py) run
through megalite's schedule simulator (the real action lists of the layout's schedule, one
cost per rank and chunk, the pipeline send as the message latency), then the data-parallel
gradient reduction (overlapped with the last micro-batch's backward under
--overlap-grad-reduce), the tied-embedding all-reduce, the optimizer step and the distributed
optimizer's parameter all-gather (overlapped with the next step's first forward). Under FSDP2
each micro-batch all-gathers every layer's weights in forward and again in backward, prefetched
one layer ahead (hidden behind the compute where that is longer; the first layer's gather is
not), and the last micro-batch's backward reduce-scatters the fp32 gradients (the last layer's
after the compute has ended).

Processes sharing a CPU (cluster.slowdown, measured by --calibrate) compute more slowly the more
of them compute at once: the compute times are for one process alone, and every stretch of
the simulated timeline lasts longer by the measured slowdown at the number of processes
computing in it (processor sharing: ranks waiting in a bubble leave the cores to the others;
the TP x CP x DP replicas of a pipeline rank compute in lockstep between their collectives, so
their compute is crowded by all of them however long the collectives take); the optimizer
steps of all ranks run at once ("shared cores").

`estimate` replaces the simulator by the bubble formula (p-1)/v of a stage's F+B: the search
uses it to choose which layouts to simulate.
"""

from dataclasses import dataclass, field
from functools import lru_cache

from megalite.parallel.pipeline.schedules import all_ranks
from megalite.parallel.pipeline.simulator import Costs, simulate
from megalite.parallel.pipeline.stage_layout import stage_layers
from megalite.planner.cluster import Cluster
from megalite.planner.fp8 import is_fp8_layer
from megalite.planner.compute import ChunkTimes, embedding_times, groups_of, layer_times, output_times
from megalite.planner.layouts import Layout
from megalite.planner.memory import RankMemory, peak_memory, state_bytes
from megalite.planner.op_count import op_counts
from megalite.planner.optimizer_step import optimizer_step_seconds
from megalite.planner.parameters import layer_parameters, rank_parameters
from megalite.planner.workload import Workload
from megalite.training.flops import flops_per_token

PARTS = ("matmul", "attention", "memory-bound", "operators", "tensor-parallel", "context-parallel", "expert-parallel",
         "pipeline bubble + p2p", "shared cores", "data-parallel", "optimizer")
COMPUTE_PARTS = ("matmul", "attention", "memory-bound", "operators")


@dataclass
class Prediction:
    layout: Layout
    step_time: float
    breakdown: dict
    """Seconds per step by PARTS on the rank that finishes last."""
    memory: RankMemory
    tokens_per_second_per_gpu: float
    model_tflops_per_gpu: float
    """formulas.md's model FLOPs (no recompute) per second per GPU, in TFLOP/s."""
    mfu: float | None
    simulated: bool = True
    notes: list = field(default_factory=list)


def chunk_times(cluster: Cluster, workload: Workload, layout: Layout) -> list[list[ChunkTimes]]:
    """[rank][chunk] time of one micro-batch."""
    config = workload.config
    ops = ((0, 0), (0, 0))
    if cluster.op_overhead:
        ops = op_counts(config)
    per_layer = {}
    table = []
    split = workload.layer_split(layout.pp, layout.vp)
    for rank in range(layout.pp):
        row = []
        for chunk in range(layout.vp):
            times = ChunkTimes()
            for layer in stage_layers(config.num_layers, layout.pp, rank, chunk, layout.vp, **split):
                kind = (config.moe is not None and config.moe.is_moe_layer(layer, config.num_layers),
                        is_fp8_layer(workload, layer),
                        config.gdn is not None and config.gdn.is_linear_layer(layer, config.num_layers))
                if kind not in per_layer:
                    per_layer[kind] = layer_times(cluster, workload, layout, layer, ops[0])
                times += per_layer[kind]
            if rank == 0 and chunk == 0:
                times += embedding_times(cluster, workload, layout)
            if rank == layout.pp - 1 and chunk == layout.vp - 1:
                times += output_times(cluster, workload, layout)
                times.add("operators", ops[1][0] * cluster.op_overhead, ops[1][1] * cluster.op_overhead)
            row.append(times)
        table.append(row)
    return table


def p2p_time(cluster: Cluster, workload: Workload, layout: Layout) -> float:
    """One activation (or its gradient) sent to the next pipeline stage: b x s x h, split t ways
    with sequence parallelism; across nodes wherever any neighbour pair is."""
    if layout.pp == 1:
        return 0.0
    split = layout.tp if layout.sequence_parallel else 1
    nbytes = layout.micro_batch_size * workload.seq_length / layout.cp * workload.config.hidden_size \
        * workload.activation_bytes / split
    pp = groups_of(layout)["pp"]
    pairs = list(zip(pp, pp[1:] + pp[:1]))
    crossing = next(((a, b) for a, b in pairs if cluster.node_of(a) != cluster.node_of(b)), pairs[0])
    return cluster.collective_time("p2p", nbytes, list(crossing))


@lru_cache(maxsize=64)
def _actions(schedule: str, p: int, m: int, v: int) -> list:
    return all_ranks(schedule, p, m, v)


@lru_cache(maxsize=256)
def _simulate(schedule: str, p: int, m: int, v: int, costs: tuple):
    """(makespan, each rank's finish, the compute intervals (start, end) of every rank)."""
    report = simulate(_actions(schedule, p, m, v), v, [list(row) for row in costs])
    intervals = tuple(tuple((start, end) for action, start, end in r.timeline if action.is_compute and end > start)
                      for r in report.ranks)
    return report.makespan, tuple(r.finish for r in report.ranks), intervals


def shared_core_time(intervals, replicas: float, share: list[float], cluster: Cluster) -> float:
    """Wall time of the simulated pipeline when its processes share a CPU. `replicas`: the
    processes of each pipeline rank (its TP x CP x DP replicas), which compute and communicate
    in lockstep (every TP collective waits for all of them); share[r]: the part of pipeline rank
    r's busy time that computes. While a rank computes, all its replicas do, beside the other
    busy ranks' replicas in the shares of time those compute: that number of processes sets its
    compute's slowdown (cluster.slowdown_at); its collectives, measured with every rank
    communicating, are not stretched again. A stretch of the timeline lasts longer by the mean
    of its busy ranks' factors."""
    events = sorted([(start, 1, r) for r, rank in enumerate(intervals) for start, _ in rank]
                    + [(end, -1, r) for r, rank in enumerate(intervals) for _, end in rank])
    busy: dict[int, int] = {}
    wall, last = 0.0, 0.0
    for time, change, rank in events:
        if time > last:
            if busy:
                others = sum(replicas * share[r] for r in busy)
                factors = [share[r] * cluster.slowdown_at(replicas + others - replicas * share[r]) + 1 - share[r]
                           for r in busy]
                wall += (time - last) * sum(factors) / len(factors)
            else:
                wall += time - last
            last = time
        busy[rank] = busy.get(rank, 0) + change
        if not busy[rank]:
            del busy[rank]
    return wall


@lru_cache(maxsize=4096)
def _stage_groups(world: int, tp: int, pp: int, vp: int, cp: int, ep: int, rank: int) -> tuple:
    """The DP x CP group and (with experts) the EDP group of pipeline rank `rank`'s first rank,
    and the first and last stages' first ranks."""
    layout = Layout(tp, pp, world // (tp * pp * cp), vp, cp, ep)
    parallel = layout.parallel_layout()
    group = [parallel.rank_of(0, d, rank, c) for d in range(layout.dp) for c in range(layout.cp)]
    stride = parallel.rank_of(0, 0, rank) - parallel.rank_of(0, 0, 0)
    edp = [r + stride for r in groups_of(layout)["edp"]]
    return group, edp, [parallel.rank_of(0, 0, 0), parallel.rank_of(0, 0, pp - 1)]


def _data_parallel(cluster: Cluster, workload: Workload, layout: Layout, rank: int) -> tuple[float, float, float]:
    """(gradient reduction, parameter all-gather, tied-embedding all-reduce) seconds of pipeline
    rank `rank`."""
    dense, expert = rank_parameters(workload.config, layout.tp, layout.pp, layout.vp, rank, layout.ep,
                                    workload.layer_split(layout.pp, layout.vp))
    weight, grad = state_bytes(workload.precision, 1, False, 1)[:2]
    group, edp, ends = _stage_groups(layout.world_size, layout.tp, layout.pp, layout.vp, layout.cp, layout.ep, rank)
    groups = [(dense, group)]
    if expert:
        groups.append((expert, edp))
    reduce = gather = 0.0
    for count, ranks in groups:
        if layout.fsdp2:  # fp32 gradients (FSDP2's reduce dtype); weights gathered in the compute dtype
            reduce += cluster.collective_time("reduce_scatter", count * 4, ranks)
            gather += cluster.collective_time("all_gather", count * workload.activation_bytes, ranks)
        elif layout.distributed_optimizer:
            reduce += cluster.collective_time("reduce_scatter", count * grad, ranks)
            gather += cluster.collective_time("all_gather", count * weight, ranks)
        else:
            reduce += cluster.collective_time("all_reduce", count * grad, ranks)
    embedding = 0.0
    tied = not workload.config.untie_embeddings_and_output_weights
    if tied and layout.pp > 1 and rank in (0, layout.pp - 1):
        vocab = workload.config.padded_vocab_size(layout.tp) // layout.tp * workload.config.hidden_size
        embedding = cluster.collective_time("all_reduce", vocab * grad, ends)
    return reduce, gather, embedding


def _fsdp2_exposed(workload: Workload, layout: Layout, reduce: float, gather: float, forward: float,
                   backward: float, m: int) -> float:
    """Seconds of FSDP2's all-gathers (`gather`: every weight once) and reduce-scatter (`reduce`)
    not hidden behind a micro-batch's `forward` / `backward`, over the step's `m` micro-batches."""
    dense = rank_parameters(workload.config, layout.tp, 1, 1, 0)[0]
    layer = max(layer_parameters(workload.config, i, layout.tp)[0] for i in range(workload.config.num_layers))
    share = layer / dense  # one layer's part of a full gather or reduce
    exposed = m * max(share * gather, gather - forward)
    exposed += (m - 1) * max(0.0, gather - backward)
    return exposed + max(share * reduce, gather + reduce - backward)


def predict(cluster: Cluster, workload: Workload, layout: Layout, memory: RankMemory | None = None,
            use_simulator: bool = True) -> Prediction:
    """Step time and its breakdown for `layout` (the simulator, or with use_simulator=False the
    bubble formula)."""
    memory = memory or peak_memory(workload, layout)
    m = layout.num_microbatches(workload.global_batch_size)
    p, v = layout.pp, layout.vp
    table = chunk_times(cluster, workload, layout)
    p2p = p2p_time(cluster, workload, layout)
    busy = [m * sum(c.forward + c.backward for c in row) for row in table]
    if use_simulator:
        costs = tuple(tuple(Costs(c.forward, c.backward - c.weight, c.weight, p2p) for c in row) for row in table)
        if layout.schedule != "zb_h1":
            costs = tuple(tuple(Costs(c.forward, c.backward + c.weight, 0, c.p2p_latency) for c in row) for row in costs)
        makespan, finish, intervals = _simulate(layout.schedule, p, m, v, costs)
    else:
        stage = max(sum(c.forward + c.backward for c in row) for row in table)
        makespan = max(busy) + (p - 1) / v * stage + (2 * (p - 1) * p2p if p > 1 else 0.0)
        finish = tuple(makespan for _ in range(p))
        intervals = tuple(((0.0, b),) for b in busy)
    share = cluster.slowdown_at(layout.world_size)
    contention = 0.0
    if cluster.slowdown:  # the stretch processor sharing adds to the simulated compute
        computing = [sum(c.parts.get(k, 0.0) for c in row for k in COMPUTE_PARTS) / sum(c.forward + c.backward for c in row)
                     for row in table]
        end = max((e for rank in intervals for _, e in rank), default=0.0)
        contention = max(0.0, shared_core_time(intervals, layout.world_size / p, computing, cluster) - end)
    ends, details = [], []
    overlap = layout.dp * layout.cp > 1  # the printed flags turn --overlap-grad-reduce on
    for rank, row in enumerate(table):
        reduce, gather, embedding = _data_parallel(cluster, workload, layout, rank)
        last_backward = sum(c.backward for c in row)
        first_forward = sum(c.forward for c in row)
        if layout.fsdp2:
            exposed = _fsdp2_exposed(workload, layout, reduce, gather, first_forward, last_backward, m)
        else:
            exposed = max(0.0, reduce - last_backward) if overlap else reduce
            exposed += max(0.0, gather - first_forward) if overlap else gather
        optimizer = optimizer_step_seconds(cluster, workload, layout, rank) * share
        ends.append(finish[rank] + contention + exposed + embedding + optimizer)
        details.append((exposed + embedding, optimizer))
    step = max(ends)
    critical = max(range(p), key=lambda r: ends[r])
    parts = dict.fromkeys(PARTS, 0.0)
    for chunk in table[critical]:
        for kind, value in chunk.parts.items():
            parts[kind] += m * value
    parts["shared cores"] = contention
    parts["pipeline bubble + p2p"] = max(0.0, step - busy[critical] - contention - sum(details[critical]))
    parts["data-parallel"], parts["optimizer"] = details[critical]
    tokens = workload.global_batch_size * workload.seq_length
    per_gpu = tokens / step / layout.world_size
    model_flops = flops_per_token(workload.config, workload.seq_length, workload.config.padded_vocab_size(layout.tp))
    tflops = model_flops * per_gpu / 1e12
    mfu = model_flops * per_gpu / cluster.peak_flops if not cluster.measured else None
    return Prediction(layout, step, parts, memory, per_gpu, tflops, mfu, use_simulator)
