"""Time of one micro-batch through one model chunk on one rank: matmuls, memory-bound kernels,
operator overhead, and the tensor-, context- and expert-parallel communication that cannot
overlap them.

On a cluster whose kernels were measured (cluster.kernels: the h100 and h200 presets), the
attention core, the memory-bound kernels and the host's waits are gpu_kernels.py's; otherwise:

Matmuls: each GEMM takes max(FLOPs / (peak x matmul efficiency), bytes / memory bandwidth) (a
roofline), with FLOPs counted as formulas.md counts them (2 per multiply-add, attention
non-causal); the backward is twice the forward (input and weight gradients). Memory-bound
kernels (norms, residual adds, activations, rotary, softmax and dropout without a flash
kernel, the loss) move the elements listed in `_elementwise_elements`, the backward twice
the forward's; every micro-batch's backward also adds each weight's gradient into its
main-gradient buffer (megalite's DistributedDataParallel: read the gradient, read and write the
buffer). Operators cost `cluster.op_overhead` each, counted by running the model
(megalite.planner.op_count). Recompute adds its forward to the backward: the whole layer
(full) or the attention core (selective).

Communication per layer and micro-batch, as megalite's layers issue it: tensor parallelism 2
all-reduces forward and 2 backward of the b x s x h activation (with sequence parallelism an
all-gather and a reduce-scatter for each, formulas.md); the embedding's and output layer's
and the vocab-parallel loss's collectives; a context-parallel ring passing K and V blocks
(dK, dV as well in the backward), hidden behind the attention core it overlaps (a Gated
DeltaNet layer instead: two all-to-alls forward and two backward, not overlapped); the expert
all-to-all dispatch and combine (the planner's launch lines choose the all-to-all dispatcher),
with tokens spread evenly over the experts.
"""

from dataclasses import dataclass, field
from functools import lru_cache

from megalite.parallel.expert.groups import ExpertLayout
from megalite.planner.cluster import Cluster
from megalite.planner.fp8 import fp8_layer_seconds
from megalite.planner.gpu_kernels import (accumulated_parameters, accumulation_bytes, attention_seconds, embedding_seconds, measured_layer,
                                          output_seconds)
from megalite.planner.layouts import Layout
from megalite.planner.parameters import layer_parameters
from megalite.planner.workload import Workload


@dataclass
class ChunkTimes:
    """Seconds one micro-batch spends in one chunk; `parts` splits them by kind."""

    forward: float = 0.0
    backward: float = 0.0
    """The whole backward, recompute included."""
    weight: float = 0.0
    """The weight-gradient GEMMs within `backward` (what ZB-H1 defers)."""
    parts: dict = field(default_factory=dict)

    def add(self, kind: str, forward: float, backward: float) -> None:
        self.forward += forward
        self.backward += backward
        self.parts[kind] = self.parts.get(kind, 0.0) + forward + backward

    @classmethod
    def of(cls, parts: list, weight: float = 0.0) -> "ChunkTimes":
        """From [(kind, forward, backward)] and the weight-gradient GEMMs' seconds."""
        times = cls(weight=weight)
        for kind, forward, backward in parts:
            times.add(kind, forward, backward)
        return times

    def __iadd__(self, other: "ChunkTimes") -> "ChunkTimes":
        self.forward += other.forward
        self.backward += other.backward
        self.weight += other.weight
        for kind, value in other.parts.items():
            self.parts[kind] = self.parts.get(kind, 0.0) + value
        return self


def accumulation_time(cluster: Cluster, workload: Workload, num_params: float) -> float:
    """Adding one micro-batch's weight gradients into the main-gradient buffers."""
    return accumulation_bytes(workload, num_params) / cluster.memory_bandwidth


def gemm_time(cluster: Cluster, m: float, k: float, n: float, element: int, batch: float = 1) -> float:
    """Roofline time of `batch` GEMMs of [m, k] x [k, n]."""
    flops = 2 * m * k * n * batch
    nbytes = element * (m * k + k * n + m * n) * batch
    return max(flops / cluster.matmul_flops, nbytes / cluster.memory_bandwidth)


def _score_elements(workload: Workload, layout: Layout, tokens: float) -> float:
    """Elements the softmax and dropout of attention without a flash kernel read and write (the
    part selective recompute redoes); none with one."""
    if workload.flash_attention:
        return 0.0
    return 4 * tokens * workload.seq_length * workload.config.num_attention_heads / layout.tp


def _elementwise_elements(workload: Workload, layout: Layout, tokens: float, moe_layer: bool) -> float:
    """Elements memory-bound kernels read and write in one layer's forward on one rank."""
    config, t = workload.config, layout.tp
    h, f = config.hidden_size, config.ffn_hidden_size
    q, kv = config.num_attention_heads * config.kv_channels, config.num_query_groups * config.kv_channels
    split = t if layout.sequence_parallel else 1
    elements = 2 * 2 * tokens * h / split                     # two norms: read, write
    elements += 2 * 3 * tokens * h / split                    # two residual adds (+ dropout)
    if config.position_embedding_type == "rope":
        elements += 2 * tokens * (q + kv) / t                 # rotary on q and k: read, write
    if moe_layer:
        moe = config.moe
        ffn_tokens, f = tokens * moe.router_topk, moe.ffn_hidden_size
        elements += 3 * tokens * moe.num_experts              # router scores, top-k
    else:
        ffn_tokens = tokens
    up = 2 if config.activation == "swiglu" else 1
    elements += ffn_tokens * f * (up + 1) / t                 # activation: read, write
    return elements + _score_elements(workload, layout, tokens)


def layer_gemms(workload: Workload, layout: Layout, tokens: float, moe_layer: bool) -> list[tuple]:
    """(m, k, n, batch, kind) of one layer's forward GEMMs on one rank; kind 'core' for the
    attention scores and their product with V, 'router' for the MoE router and shared-expert
    gate (the same on every TP rank), 'dense' for the rest."""
    config, t = workload.config, layout.tp
    h, d = config.hidden_size, config.kv_channels
    q, kv = config.num_attention_heads * d, config.num_query_groups * d
    up = 2 if config.activation == "swiglu" else 1
    gemms = [(tokens, h, (q + 2 * kv) / t, 1, "dense"), (tokens, q / t, h, 1, "dense")]
    if moe_layer:
        moe = config.moe
        rows = tokens * moe.router_topk             # rows this EP rank's experts receive (balanced)
        local = moe.num_experts // layout.ep
        gemms += [(tokens, h, moe.num_experts, 1, "router"),
                  (rows / local, h, up * moe.ffn_hidden_size / t, local, "dense"),
                  (rows / local, moe.ffn_hidden_size / t, h, local, "dense")]
        if moe.shared_expert_intermediate_size:
            shared = moe.shared_expert_intermediate_size
            gemms += [(tokens, h, up * shared / t, 1, "dense"), (tokens, shared / t, h, 1, "dense")]
            gemms += [(tokens, h, 1, 1, "router")] if moe.shared_expert_gate else []
    else:
        f = config.ffn_hidden_size
        gemms += [(tokens, h, up * f / t, 1, "dense"), (tokens, f / t, h, 1, "dense")]
    heads = config.num_attention_heads / t * layout.micro_batch_size
    rows = tokens / layout.micro_batch_size
    gemms += [(rows, d, workload.seq_length, heads, "core"), (rows, workload.seq_length, d, heads, "core")]
    return gemms


def _layer_gemms(cluster: Cluster, workload: Workload, layout: Layout, tokens: float, moe_layer: bool):
    """(projection and MLP GEMM time, attention-core GEMM time) of one layer's forward."""
    times = {"dense": 0.0, "core": 0.0}
    for m, k, n, batch, kind in layer_gemms(workload, layout, tokens, moe_layer):
        times["core" if kind == "core" else "dense"] += gemm_time(cluster, m, k, n, workload.activation_bytes, batch)
    return times["dense"], times["core"]


@lru_cache(maxsize=4096)
def _groups(world: int, tp: int, pp: int, vp: int, cp: int, ep: int):
    """Rank lists of rank 0's TP, CP, DP x CP and EP groups, and its pipeline neighbours."""
    from megalite.parallel.state import ParallelLayout
    parallel = ParallelLayout(world, tensor=tp, pipeline=pp, virtual_pipeline=vp, context=cp)
    layout = Layout(tp, pp, world // (tp * pp * cp), vp, cp, ep)
    tp, cp, dp_cp, pp = parallel.tp_groups()[0], parallel.cp_groups()[0], parallel.dp_cp_groups()[0], parallel.pp_groups()[0]
    ep = ExpertLayout(parallel, layout.ep).ep_groups()[0] if layout.ep > 1 else [0]
    edp = ExpertLayout(parallel, layout.ep).edp_groups()[0] if layout.ep > 1 else dp_cp
    return {"tp": tp, "cp": cp, "dp_cp": dp_cp, "pp": pp, "ep": ep, "edp": edp}


def groups_of(layout: Layout) -> dict:
    return _groups(layout.world_size, layout.tp, layout.pp, layout.vp, layout.cp, layout.ep)


def _tp_comm(cluster: Cluster, layout: Layout, activation_bytes: float, group) -> float:
    """One all-reduce of the layer activation, or with SP an all-gather plus a reduce-scatter."""
    if layout.tp == 1:
        return 0.0
    if layout.sequence_parallel:
        return (cluster.collective_time("all_gather", activation_bytes, group)
                + cluster.collective_time("reduce_scatter", activation_bytes, group))
    return cluster.collective_time("all_reduce", activation_bytes, group)


def _roofline_layer(cluster: Cluster, workload: Workload, layout: Layout, tokens: float, moe_layer: bool,
                    dense: float, core: float, accumulate: float, ops: tuple) -> ChunkTimes:
    """A layer's compute by the roofline: GEMMs at the matmul rate, elementwise work at the
    memory bandwidth, `ops` operators at cluster.op_overhead each."""
    e = workload.activation_bytes
    times = ChunkTimes()
    elementwise = _elementwise_elements(workload, layout, tokens, moe_layer) * e / cluster.memory_bandwidth
    overhead_f, overhead_b = ops[0] * cluster.op_overhead, ops[1] * cluster.op_overhead
    times.add("matmul", dense + core, 2 * (dense + core) + (dense + core if layout.recompute == "full" else
                                                            core if layout.recompute == "selective" else 0))
    times.weight += dense + core
    redone = {"none": 0.0, "full": elementwise,
              "selective": _score_elements(workload, layout, tokens) * e / cluster.memory_bandwidth}[layout.recompute]
    times.add("memory-bound", elementwise, 2 * elementwise + redone + accumulate)
    times.add("operators", overhead_f, overhead_b + (overhead_f if layout.recompute == "full" else 0))
    return times


def layer_times(cluster: Cluster, workload: Workload, layout: Layout, layer: int, ops: tuple) -> ChunkTimes:
    """One transformer layer, one micro-batch, one rank. `ops` = (forward, backward) operators
    per layer (zeros where op overhead is not modelled)."""
    config, e = workload.config, workload.activation_bytes
    moe = config.moe
    moe_layer = moe is not None and moe.is_moe_layer(layer, config.num_layers)
    tokens = layout.micro_batch_size * workload.seq_length / layout.cp
    groups = groups_of(layout)
    times = ChunkTimes()
    dense, core = _layer_gemms(cluster, workload, layout, tokens, moe_layer)
    fp8_f, fp8_b, cast_f, cast_b = fp8_layer_seconds(cluster, workload, layout, layer, groups["tp"])
    dense += fp8_f  # the backward's GEMMs are taken as twice the forward's below; fp8_b corrects that
    accumulate = accumulation_bytes(workload, accumulated_parameters(workload, layer, layout))
    if cluster.kernels is not None:
        count = sum(1 for *_, kind in layer_gemms(workload, layout, tokens, moe_layer) if kind != "core")
        times = ChunkTimes.of(*measured_layer(cluster, workload, layout, tokens, moe_layer, (dense, core, count),
                                              accumulate, _score_elements(workload, layout, tokens)))
        if workload.flash_attention:
            core = attention_seconds(cluster, workload, layout, tokens)[0]
    else:
        times = _roofline_layer(cluster, workload, layout, tokens, moe_layer, dense, core,
                                accumulate / cluster.memory_bandwidth, ops)
    if workload.fp8 is not None:
        full = layout.recompute == "full"
        times.add("matmul", 0.0, fp8_b - 2 * fp8_f)
        times.weight += fp8_b - 2 * fp8_f
        times.add("memory-bound", cast_f, cast_b + (cast_f if full else 0.0))
    activation = tokens * config.hidden_size * e
    tp = 2 * _tp_comm(cluster, layout, activation, groups["tp"])
    regather = 0.0
    if layout.tp > 1 and layout.sequence_parallel:
        # the QKV and FC1 linears keep their input's sequence shard and gather it again in
        # backward, overlapped with their input-gradient matmuls (about the forward's GEMMs)
        regather = max(0.0, 2 * cluster.collective_time("all_gather", activation, groups["tp"]) - dense)
    times.add("tensor-parallel", tp, tp * (2 if layout.recompute == "full" else 1) + regather)
    if layout.cp > 1 and config.gdn is not None and config.gdn.is_linear_layer(layer, config.num_layers):
        # a Gated DeltaNet layer: in_proj's output to whole sequences (all-to-all), out_proj's
        # input back; their gradients the same way in backward; nothing overlaps them
        gdn = config.gdn
        a2a = sum(cluster.collective_time("all_to_all", tokens * channels / layout.tp * e, groups["cp"])
                  for channels in (sum(gdn.in_proj_sections()), gdn.v_dim))
        times.add("context-parallel", a2a, a2a * (2 if layout.recompute == "full" else 1))
    elif layout.cp > 1:
        kv_block = 2 * tokens * config.num_query_groups * config.kv_channels / layout.tp * e
        neighbours = groups["cp"][:2] if len({cluster.node_of(r) for r in groups["cp"]}) == 1 else \
            [groups["cp"][0], next(r for r in groups["cp"] if cluster.node_of(r) != cluster.node_of(groups["cp"][0]))]
        hop = cluster.collective_time("p2p", kv_block, neighbours)
        steps = layout.cp - 1
        hidden = core * steps / layout.cp
        forward = max(0.0, steps * hop - hidden)
        backward = max(0.0, 2 * steps * hop - 2 * hidden)
        times.add("context-parallel", forward, backward + (forward if layout.recompute == "full" else 0))
    if moe_layer and layout.ep > 1:
        split = layout.tp if layout.sequence_parallel else 1
        dispatched = tokens / split * moe.router_topk * config.hidden_size * e
        a2a = 2 * cluster.collective_time("all_to_all", dispatched, groups["ep"])
        times.add("expert-parallel", a2a, a2a * (2 if layout.recompute == "full" else 1))
    return times


def embedding_times(cluster: Cluster, workload: Workload, layout: Layout) -> ChunkTimes:
    """The first chunk's embedding: the vocab-parallel lookup's reduction (no FLOPs)."""
    tokens = layout.micro_batch_size * workload.seq_length / layout.cp
    activation = tokens * workload.config.hidden_size * workload.activation_bytes
    vocab = workload.config.padded_vocab_size(layout.tp) // layout.tp * workload.config.hidden_size
    if cluster.kernels is not None:
        times = ChunkTimes.of(embedding_seconds(cluster, workload, layout, tokens, vocab / workload.config.hidden_size,
                                                accumulation_bytes(workload, vocab)))
    else:
        times = ChunkTimes()
        lookup = 2 * activation / cluster.memory_bandwidth
        times.add("memory-bound", lookup, lookup + accumulation_time(cluster, workload, vocab))
    if layout.tp > 1:
        kind = "reduce_scatter" if layout.sequence_parallel else "all_reduce"
        times.add("tensor-parallel", cluster.collective_time(kind, activation, groups_of(layout)["tp"]), 0.0)
    return times


def output_times(cluster: Cluster, workload: Workload, layout: Layout) -> ChunkTimes:
    """The last chunk's final norm, output layer and vocab-parallel cross-entropy."""
    config, e, t = workload.config, workload.activation_bytes, layout.tp
    tokens = layout.micro_batch_size * workload.seq_length / layout.cp
    vocab = config.padded_vocab_size(t) / t
    untied = config.untie_embeddings_and_output_weights or layout.pp > 1 or layout.vp > 1
    fused = workload.gradient_accumulation_fusion  # the output layer's weight gradient accumulates in its GEMM
    accumulate = accumulation_bytes(workload, vocab * config.hidden_size) if untied and not fused else 0.0
    gemm = gemm_time(cluster, tokens, config.hidden_size, vocab, e)
    if cluster.kernels is not None:
        times = ChunkTimes.of(output_seconds(cluster, workload, layout, tokens, vocab, accumulate, gemm), gemm)
    else:
        times = ChunkTimes(weight=gemm)
        times.add("matmul", gemm, 2 * gemm)
        loss = (4 * tokens * vocab + 4 * tokens * config.hidden_size) * 4 / cluster.memory_bandwidth  # fp32 loss
        times.add("memory-bound", loss, 2 * loss + accumulate / cluster.memory_bandwidth)
    if t > 1:
        group = groups_of(layout)["tp"]
        activation = tokens * config.hidden_size * e
        gather = cluster.collective_time("all_gather", activation, group) if layout.sequence_parallel else 0.0
        scatter = cluster.collective_time("reduce_scatter" if layout.sequence_parallel else "all_reduce",
                                          activation, group)
        loss_comm = 3 * cluster.collective_time("all_reduce", tokens * 4, group)
        times.add("tensor-parallel", gather + loss_comm, scatter)
    return times
