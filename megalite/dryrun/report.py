"""The dry run's printed tables: per pipeline stage, peak memory by category; per measured rank,
activations beside the formula, held bytes beside formulas.md and bytes per process group; last,
the verdict: the highest peak, its stage, and whether it fits the GPU's memory."""

from megalite.dryrun.balanced_routing import ASSUMPTION
from megalite.dryrun.runner import CATEGORIES
from megalite.dryrun.stages import stage_label, stage_name
from megalite.config.context import cp_comm_types_of

MIB = 1024 ** 2
GIB = 1024 ** 3
HEADROOM = 0.9
"""Of the GPU's memory, what the measured tensors may fill: the rest is for what a dry run does
not count (the CUDA context, NCCL's buffers, the caching allocator's fragmentation), as
tools/plan.py keeps by default (--memory-fraction 0.9)."""
SENDS = {"cuda": ("note: a pipeline send is held until its peer receives it, as the pipeline schedule simulated "
                  "over every stage has it (NCCL; the fake process group's works never complete)"),
         "cpu": ("note: pipeline sends are held to the end of the step, as a gloo run holds them (gloo's send "
                 "works report completion only when waited on)")}


def _mib(n: int) -> str:
    return f"{n / MIB:10.3f}"


def _stage_table(layout, stages, reports, all_stages: bool) -> list[str]:
    if layout.pipeline == 1 or all_stages:
        which = "one pipeline stage" if layout.pipeline == 1 else "every pipeline stage (--dry-run-all-stages)"
    else:
        which = (f"{len(stages)} distinct of the {layout.pipeline} pipeline stages (stages alike in layers, role and "
                 "schedule hold the same memory, megalite/dryrun/stages.py: the lowest of them is measured)")
    lines = [f"{which}; measured at TP rank 0, DP rank 0 (a stage's other ranks hold the same shapes)",
             "peak memory per pipeline stage in a steady iteration (MiB, MemTracker categories at the peak):",
             f"{'stages':>10} {'rank':>6} {'layers':>7} " + " ".join(f"{c:>11}" for c in CATEGORIES)
             + f" {'total':>11}  held = formulas.md"]
    for group, r in zip(stages, reports):
        layers = "+".join(str(len(chunk_layers)) for chunk_layers, _, _ in r.chunks)
        lines.append(f"{stage_label(group):>10} {r.rank:>6} {layers:>7} "
                     + " ".join(f"{_mib(r.peak.get(c, 0)):>11}" for c in CATEGORIES)
                     + f" {_mib(r.peak_total):>11}  {'yes' if r.resident == r.formula else 'NO'}")
    return lines


def _over(stages, reports, gib: float) -> str:
    """On which of the pipeline stages the peak exceeds `gib` GiB, e.g. 'on stages 1-9 (9 of 16)'
    ('' without pipeline parallelism)."""
    total = sum(map(len, stages))
    over = sorted(s for group, r in zip(stages, reports) if r.peak_total > gib * GIB for s in group)
    return f", on {stage_name(over)} ({len(over)} of {total})" if total > 1 else ""


def verdict(stages, reports, gpu_memory_gib: float) -> str:
    """One line: the highest peak, the stages its rank stands for, and FITS / TIGHT / DOES NOT FIT
    a GPU of `gpu_memory_gib` GiB (TIGHT: over HEADROOM of it, under all of it)."""
    group, top = max(zip(stages, reports), key=lambda pair: pair[1].peak_total)
    peak, limit, room = top.peak_total / GIB, gpu_memory_gib, HEADROOM * gpu_memory_gib
    where = f"pipeline {stage_name(group)} (rank {top.rank} measured)" if len(stages) > 1 else f"rank {top.rank}"
    head = f"verdict: highest peak {peak:.2f} GiB ({top.peak_total / MIB:,.0f} MiB) on {where}"
    gpu = f"a GPU of {limit:g} GiB (--dry-run-gpu-memory-gib)"
    fill = f"the {room:.2f} GiB ({HEADROOM:.0%}) that tensors may fill"
    rest = (f"the other {1 - HEADROOM:.0%} is for the CUDA context, NCCL's buffers and allocator fragmentation, "
            "which a dry run does not count, as tools/plan.py keeps")
    if peak > limit:
        return f"{head}: DOES NOT FIT {gpu}: {peak - limit:.2f} GiB over{_over(stages, reports, limit)}"
    if peak > room:
        return (f"{head}: TIGHT: {limit - peak:.2f} GiB under {gpu} but {peak - room:.2f} GiB over {fill}"
                f"{_over(stages, reports, room)}; {rest}")
    return f"{head}: FITS {gpu}: {room - peak:.2f} GiB to spare under {fill}; {rest}"


def format_report(args, layout, stages, reports) -> str:
    """`stages[i]`: the pipeline ranks `reports[i]` (one measured rank) stands for."""
    dtype = "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"
    cp = f" x CP {layout.context} ({' '.join(cp_comm_types_of(args))})" if layout.context > 1 else ""
    etp = args.expert_tensor_parallel_size or layout.tensor
    ep = (f"; {args.num_experts} experts top-{args.moe_router_topk}, EP {args.expert_model_parallel_size} "
          f"x ETP {etp} ({args.moe_token_dispatcher_type})" if args.num_experts is not None else "")
    lines = [f"dry run: world {layout.world_size} = TP {layout.tensor}{cp} x PP {layout.pipeline} "
             f"(x{layout.virtual_pipeline} virtual) x DP {layout.data}{ep}, {dtype}, "
             f"{args.num_micro_batches} micro-batches of {args.micro_batch_size} x {args.seq_length}, "
             f"device {args.dry_run_device} (fake)",
             *([ASSUMPTION] if args.num_experts is not None else []),
             *([SENDS["cpu" if args.dry_run_device == "cpu" else "cuda"]] if layout.pipeline > 1 else []),
             *_stage_table(layout, stages, reports, args.dry_run_all_stages)]
    if any(r.korthikanti for r in reports):
        lines.append("most activations held at once beside Korthikanti et al.'s formula (formulas.md, no s x s "
                     "scores) for the transformer layers in flight (MiB; the embedding and the last stage's logits "
                     "are not in it)")
        for r in reports:
            ratio = f"{r.activation_peak / r.korthikanti:.3f}" if r.korthikanti else "-"
            lines.append(f"{r.rank:>6} {str(r.coords):>15} {_mib(r.activation_peak)} formula "
                         f"{_mib(r.korthikanti or 0)} ratio {ratio}")
    lines.append("held after the step (bytes): parameters, gradients, optimizer state; formulas.md for the "
                 "rank's parameters (padded as in its gradient buffers) beside them")
    for r in reports:
        held = " ".join(f"{r.resident.get(c, 0):>14,d}" for c in CATEGORIES[:3])
        formula = " ".join(f"{r.formula.get(c, 0):>14,d}" for c in CATEGORIES[:3])
        lines.append(f"{r.rank:>6} {str(r.coords):>15} {held}   formula {formula}   "
                     f"({r.num_params:,d} parameters, {r.num_buffer:,d} padded)")
    lines.append("bytes each rank sends into each process group per iteration (MiB, calls):")
    for r in reports:
        parts = [f"{g} {k} {_mib(b).strip()} ({r.calls[(g, k)]})" for (g, k), b in sorted(r.comm.items())]
        lines.append(f"{r.rank:>6}  " + ("; ".join(parts) or "none"))
    for r in reports:
        for name, (counted, formula) in r.checks.items():
            lines.append(f"{r.rank:>6}  {name}: {counted:,d} bytes, formula {formula:,d}")
    lines.append(verdict(stages, reports, args.dry_run_gpu_memory_gib))
    return "\n".join(lines)
