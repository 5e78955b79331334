"""What the planner prints: the ranked layouts with predicted per-rank memory and the step-time
breakdown, and each finalist as a ready `scripts/pretrain_gpt.sh` command line."""

import shlex

from megalite.planner.memory import RankMemory
from megalite.planner.search import Plan
from megalite.planner.step import PARTS, Prediction

GIB = 2 ** 30
_SHORT = {"matmul": "matmul", "attention": "attn", "memory-bound": "membound", "operators": "ops", "tensor-parallel": "TP",
          "context-parallel": "CP", "expert-parallel": "EP", "pipeline bubble + p2p": "bubble+p2p", "shared cores": "cores",
          "data-parallel": "DP", "optimizer": "optim"}


def _seconds(value: float) -> str:
    return f"{value * 1e3:.1f}ms" if value < 1 else f"{value:.2f}s"


def memory_unit(nbytes: float) -> tuple[float, str]:
    """GiB, or MiB below 1 GiB."""
    return (GIB, "GiB") if nbytes >= GIB else (2 ** 20, "MiB")


def memory_text(memory: RankMemory) -> str:
    unit, name = memory_unit(memory.total)
    extras = "".join(f" + {label} {value / unit:.2f}" for label, value in
                     (("recompute", memory.recompute), ("logits", memory.logits), ("fp8", memory.fp8))
                     if value)
    return (f"weights {memory.parameters / unit:.2f} + grads {memory.gradients / unit:.2f} + optimizer "
            f"{memory.optimizer / unit:.2f} + activations {memory.activations / unit:.2f}{extras} = "
            f"{memory.total / unit:.2f} {name} (pipeline rank {memory.rank})")


def table(plan: Plan, top: int = 10) -> str:
    workload, cluster = plan.workload, plan.cluster
    lines = [f"cluster: {cluster.name}, {cluster.num_gpus} devices, {cluster.gpus_per_node} per node; "
             f"memory limit {plan.memory_limit / GIB:.1f} GiB per device",
             f"model: {workload.config.num_layers} layers, hidden {workload.config.hidden_size}, "
             f"{workload.config.num_attention_heads} heads, seq {workload.seq_length}, global batch "
             f"{workload.global_batch_size}, {workload.precision}, optimizer {workload.optimizer.describe()}",
             f"layouts: {plan.enumerated} enumerated, {plan.fitting} fit, {len(plan.ranked)} simulated"]
    if not plan.enumerated:
        lines.append("no layout in the search space for this model and world (FSDP2 is searched at PP 1, for dense "
                     "models, with DP x CP > 1; the distributed optimizer with DP x CP > 1)")
        return "\n".join(lines)
    if not plan.ranked:
        lines.append("no layout fits; the smallest predicted footprints:")
        lines += [f"  {layout.short()}: {memory_text(memory)}" for layout, memory in plan.rejected]
        return "\n".join(lines)
    parts = [p for p in PARTS if any(pr.breakdown[p] for pr in plan.ranked[:top])]
    unit, unit_name = memory_unit(max(p.memory.total for p in plan.ranked[:top]))
    header = (f"{'#':>2} {'layout':34} {'step':>8} {'tok/s/dev':>10} {'TFLOP/s':>8} {'MFU':>5} {'mem ' + unit_name:>8} "
              + " ".join(f"{_SHORT[p]:>10}" for p in parts))
    lines += [header, "-" * len(header)]
    for i, prediction in enumerate(plan.ranked[:top], 1):
        mfu = f"{prediction.mfu:.0%}" if prediction.mfu is not None else "n/a"
        lines.append(f"{i:>2} {prediction.layout.short():34} {_seconds(prediction.step_time):>8} "
                     f"{prediction.tokens_per_second_per_gpu:>10.1f} {prediction.model_tflops_per_gpu:>8.2f} "
                     f"{mfu:>5} {prediction.memory.total / unit:>8.2f} "
                     + " ".join(f"{_seconds(prediction.breakdown[p]):>10}" for p in parts))
    lines.append("TFLOP/s and MFU count formulas.md's model FLOPs (6 P_mm + 12 L s h per token, no recompute); "
                 "the breakdown is the slowest rank's step")
    return "\n".join(lines)


def command(plan: Plan, prediction: Prediction) -> str:
    """The launch line: nodes and processes per node for torchrun, the model's flags, the
    layout's, the batch."""
    cluster, layout, workload = plan.cluster, prediction.layout, plan.workload
    per_node = min(cluster.gpus_per_node, layout.world_size)
    nodes = layout.world_size // per_node
    env = f"NPROC_PER_NODE={per_node}" + (f" NNODES={nodes}" if nodes > 1 else "")
    flags = workload.model_flags + ["--seq-length", str(workload.seq_length),
                                    "--global-batch-size", str(workload.global_batch_size)] + layout.flags()
    return f"{env} bash scripts/pretrain_gpt.sh " + " ".join(shlex.quote(f) for f in flags)


def finalists(plan: Plan, count: int = 3, chosen: list | None = None) -> str:
    """The first `count` ranked layouts (or `chosen`, those the dry run confirmed) as launch lines."""
    lines = []
    for prediction in (plan.ranked[:count] if chosen is None else chosen):
        i = plan.ranked.index(prediction) + 1
        lines.append(f"#{i} {prediction.layout.short()}: predicted step {_seconds(prediction.step_time)}; "
                     f"memory {memory_text(prediction.memory)}")
        lines.append("   " + command(plan, prediction))
    if plan.ranked and plan.cluster.gpus_per_node < plan.cluster.num_gpus:
        lines.append("(on each node; add your data, tokenizer and learning-rate flags, and MASTER_ADDR / NODE_RANK "
                     "or run under srun)")
    return "\n".join(lines)


def narayanan_flops_per_step(num_layers: int, hidden: int, seq: int, batch: int, vocab: int) -> float:
    """FLOPs of one step as Narayanan et al. 2021 count them (their equation 3, which includes
    full activation recomputation's extra forward): 96 B s l h^2 (1 + s/6h + V/16lh)."""
    l, h, s, b, v = num_layers, hidden, seq, batch, vocab
    return 96 * b * s * l * h * h * (1 + s / (6 * h) + v / (16 * l * h))
