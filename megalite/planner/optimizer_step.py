"""The optimizer step's time on one rank, per --optimizer (planner/optimizer.py's OptimizerSpec):
the bytes its elementwise kernels move per parameter it updates, and under muon the
Newton-Schulz GEMMs and the collectives they need, counted from megalite/optimizer/muon.py.

Elementwise bytes per updated element (read + written, fp32), as megalite runs each optimizer:
- adam: fused AdamW on a GPU, one pass over main value, gradient and the two moments: 28;
- sgd: torch's foreach SGD (megalite builds it foreach): the weight decay's new gradient
  (g + wd·p) 12, the momentum's mul_ 8 and add_ 12, the update 12: 44 (32 without decay, 24
  without momentum);
- muon's scalar parameters: Adam's 28, or Lion's per-tensor ops (decay 8, lerp 12, sign 8,
  lerp_ 12, update 12): 52;
- a Muon weight: decay 8, momentum lerp_ 12 (Nesterov's lerp 12 more), the scale's two
  multiplications 16 and the update 12 on the elements the rank updates; on each matrix the
  rank orthogonalises: the Frobenius normalisation 12, the casts to bf16 and back (medium) 12,
  and with split-qkv the q, k, v copies and their concatenation 16; duplicated TP's
  concatenation of the gathered shards 8; under the distributed optimizer the zeroed sum buffer
  4 and the scale 16 on the whole matrix (FSDP2: the scale).
Every kind adds the gradient norm (4) and clipping (8) per updated element on a GPU; on a CPU
the updates are timed by --calibrate's AdamW bytes (cluster.optimizer_bytes_per_parameter) times
their bytes over Adam's 28.

Newton-Schulz (muon.newton_schulz): an [r, c] update is transposed to X [m, n], m = min(r, c);
each of --muon-num-ns-steps steps is A = X Xᵀ (2m²n FLOPs), B = bA + cA·A (2m³) and
X = aX + B·X (2m²n): 4m²n + 2m³ FLOPs, in bf16 with --muon-fp32-matmul-prec medium (fp32,
taken at half the rate as TF32 on a GPU preset, with high). Which matrices a rank orthogonalises:
- --muon-tp-mode blockwise: its TP shard alone;
- duplicated (default): the shards all-gathered over TP (fp32), the full matrix on every rank;
- distributed: its shard, the norm and each step's Gram matrix A [m, m] all-reduced over TP (m
  the unsplit dim);
- split-qkv: q, k and v of a fused QKV weight as three matrices;
- under the distributed optimizer each rank sums the TP-local update over DP x CP (an fp32
  all-reduce of the whole matrix: muon.Muon._update_sharded) and orthogonalises every whole
  matrix, not 1/(DP x CP) of them; FSDP2 all-gathers each update (fp32) and does the same.
"""

from megalite.planner.cluster import Cluster
from megalite.planner.compute import gemm_time, groups_of
from megalite.planner.layouts import Layout
from megalite.planner.optimizer import Matrix, rank_matrices
from megalite.planner.parameters import rank_parameters
from megalite.planner.workload import Workload

NORM_AND_CLIP_BYTES = 4 + 8
ADAM_BYTES = 28
LION_BYTES = 52
MUON_SHARD_BYTES = 8 + 12 + 16 + 12  # decay, momentum, scale, update (Nesterov: + 12)
MUON_MATRIX_BYTES = 12  # normalisation (bf16 casts: + 12; split-qkv copies: + 16)


def sgd_bytes(weight_decay: float, momentum: float) -> int:
    return 12 * bool(weight_decay) + (20 if momentum else 0) + 12


def update_bytes(spec, matrix: bool) -> int:
    """Elementwise bytes of the update of one element the rank updates (the Newton-Schulz
    matrices' own bytes aside)."""
    if spec.kind == "adam" or (spec.kind == "muon" and not matrix and spec.scalar == "adam"):
        return ADAM_BYTES
    if spec.kind == "sgd":
        return sgd_bytes(spec.weight_decay, spec.sgd_momentum)
    if not matrix:
        return LION_BYTES
    return MUON_SHARD_BYTES - 8 * (not spec.weight_decay) + 12 * spec.nesterov


def ns_parts(matrix: Matrix, spec, tp: int) -> list:
    """[(m, n, Gram all-reduced over TP)]: the X [m, n] (m its Gram side) one rank iterates on for
    one Muon weight (one of its `count`), per the TP mode and split-qkv."""
    parts = [(matrix.rows, matrix.cols)]
    if spec.split_qkv and matrix.qkv_split:
        groups = matrix.rows // sum(matrix.qkv_split)
        parts = [(groups * rows, matrix.cols) for rows in matrix.qkv_split]
    split = matrix.partition_dim is not None and tp > 1 and spec.tp_mode != "blockwise"
    if split and spec.tp_mode == "duplicated":  # the full matrix
        parts = [(r * tp, c) if matrix.partition_dim == 0 else (r, c * tp) for r, c in parts]
    if not split or spec.tp_mode == "duplicated":
        return [(min(r, c), max(r, c), False) for r, c in parts]
    # distributed: the shard, its unsplit dim the Gram side
    return [(c, r, True) if matrix.partition_dim == 0 else (r, c, True) for r, c in parts]


def ns_matrices(workload: Workload, layout: Layout, rank: int) -> list:
    """[(m, n, count, Gram all-reduced over TP)] of ns_parts over all Muon weights of pipeline
    rank `rank`."""
    return [(m, n, matrix.count, reduced)
            for matrix in rank_matrices(workload.config, layout.tp, layout.pp, layout.vp, rank, layout.ep,
                                        workload.layer_split(layout.pp, layout.vp))
            for m, n, reduced in ns_parts(matrix, workload.optimizer, layout.tp)]


def newton_schulz_flops(workload: Workload, layout: Layout, rank: int) -> float:
    """FLOPs of one step's orthogonalisations on pipeline rank `rank`: 4m²n + 2m³ per
    Newton-Schulz step of each X [m, n]."""
    steps = workload.optimizer.ns_steps
    return sum(count * steps * (4 * m * m * n + 2 * m ** 3) for m, n, count, _ in ns_matrices(workload, layout, rank))


def newton_schulz_seconds(cluster: Cluster, workload: Workload, layout: Layout, rank: int) -> tuple[float, float]:
    """(compute seconds, collective seconds) of Muon's orthogonalisation on pipeline rank `rank`:
    the GEMMs by compute.py's roofline, the normalisation, casts and copies at the memory rate,
    one host overhead per operator (a CPU's), and the TP / DP collectives of the module."""
    spec, groups = workload.optimizer, groups_of(layout)
    element = 2 if spec.ns_bf16 else 4
    slower = 2 if not spec.ns_bf16 and not cluster.measured else 1  # fp32 (TF32) GEMMs on a GPU preset
    rate = cluster.kernels.rate("torch") if cluster.kernels is not None else cluster.memory_bandwidth
    compute = comm = 0.0
    for m, n, count, reduced in ns_matrices(workload, layout, rank):
        gemms = gemm_time(cluster, m, n, m, element) + gemm_time(cluster, m, m, m, element) \
            + gemm_time(cluster, m, m, n, element)
        compute += count * spec.ns_steps * (slower * gemms + 3 * cluster.op_overhead)
        compute += count * (m * n * (MUON_MATRIX_BYTES + 12 * spec.ns_bf16) / rate + 8 * cluster.op_overhead)
        if reduced:
            comm += count * spec.ns_steps * cluster.collective_time("all_reduce", m * m * element, groups["tp"])
    dp_sum = layout.distributed_optimizer or layout.fsdp2
    for matrix in rank_matrices(workload.config, layout.tp, layout.pp, layout.vp, rank, layout.ep,
                                workload.layer_split(layout.pp, layout.vp)):
        local = matrix.rows * matrix.cols
        if spec.split_qkv and matrix.qkv_split:
            compute += matrix.count * 16 * local / rate
        if matrix.partition_dim is not None and layout.tp > 1 and spec.tp_mode == "duplicated":
            comm += matrix.count * cluster.collective_time("all_gather", 4 * local * layout.tp, groups["tp"])
            compute += matrix.count * 8 * local * layout.tp / rate  # the shards' concatenation
        if dp_sum:  # the scale's two multiplications on the whole matrix (and the zeroed sum buffer)
            compute += matrix.count * (16 + 4 * layout.distributed_optimizer) * local / rate
            group = groups["edp"] if matrix.expert else groups["dp_cp"]
            comm += matrix.count * cluster.collective_time("all_gather" if layout.fsdp2 else "all_reduce",
                                                           4 * local, group)
    return compute, comm


def optimizer_step_seconds(cluster: Cluster, workload: Workload, layout: Layout, rank: int) -> float:
    """The optimizer step of pipeline rank `rank`: elementwise updates of its shard, the gradient
    norm and clipping, the main parameters' copy into the 16-bit weights, zeroing the gradient
    buffers, the norm's all-reduce and (muon) the orthogonalisation."""
    spec = workload.optimizer
    dense, expert = rank_parameters(workload.config, layout.tp, layout.pp, layout.vp, rank, layout.ep,
                                    workload.layer_split(layout.pp, layout.vp))
    shards = layout.dp * layout.cp if layout.distributed_optimizer or layout.fsdp2 else 1
    expert_shards = max(1, shards // layout.ep)
    updated = dense / shards + expert / expert_shards
    ns, matrix_updated = (0.0, 0.0), 0.0
    if spec.kind == "muon":
        matrices = rank_matrices(workload.config, layout.tp, layout.pp, layout.vp, rank, layout.ep,
                                 workload.layer_split(layout.pp, layout.vp))
        matrix_updated = sum(m.numel / (expert_shards if m.expert else shards) for m in matrices)
        ns = newton_schulz_seconds(cluster, workload, layout, rank)
    update = (updated - matrix_updated) * update_bytes(spec, False) + matrix_updated * update_bytes(spec, True)
    norm = cluster.collective_time("all_reduce", 4, list(range(layout.world_size)))
    sixteen = workload.precision != "fp32"
    if cluster.kernels is not None:
        rates = cluster.kernels
        copies = (4 + workload.activation_bytes) * updated if sixteen else 0.0
        elementwise = (NORM_AND_CLIP_BYTES * updated + update) / rates.rate("optimizer")
        return elementwise + (copies + 4 * (dense + expert)) / rates.rate("torch") + sum(ns) + norm
    grad = 2 if workload.precision == "fp16" else 4
    # cluster.optimizer_bytes_per_parameter is AdamW's step (measured by --calibrate on a CPU,
    # where foreach AdamW makes several passes): the other updates in proportion to their bytes
    moved = update * cluster.optimizer_bytes_per_parameter / ADAM_BYTES + 2 * (dense + expert) * grad
    # about 20 operators: foreach AdamW's, the norm's, zeroing the buffers (host overhead on a CPU)
    return moved / cluster.memory_bandwidth + norm + 20 * cluster.op_overhead + sum(ns)
