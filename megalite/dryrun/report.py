"""The dry run's printed table: per rank, peak memory by category and bytes per process group."""

from megalite.dryrun.balanced_routing import ASSUMPTION
from megalite.dryrun.runner import CATEGORIES
from megalite.config.arguments_context import cp_comm_types_of

MIB = 1024 ** 2
SENDS = {"cuda": ("note: a pipeline send is held until its peer receives it, as the pipeline schedule simulated "
                  "over every stage has it (NCCL; the fake process group's works never complete)"),
         "cpu": ("note: pipeline sends are held to the end of the step, as a gloo run holds them (gloo's send "
                 "works report completion only when waited on)")}


def _mib(n: int) -> str:
    return f"{n / MIB:10.3f}"


def format_report(args, layout, reports) -> str:
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
             "peak memory per rank in a steady iteration (MiB, MemTracker categories at the peak):",
             f"{'rank':>6} {'(tp,dp,pp,cp)':>15} " + " ".join(f"{c:>11}" for c in CATEGORIES) + f" {'total':>11}"]
    for r in reports:
        lines.append(f"{r.rank:>6} {str(r.coords):>15} " + " ".join(f"{_mib(r.peak.get(c, 0)):>11}" for c in CATEGORIES)
                     + f" {_mib(r.peak_total):>11}")
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
    return "\n".join(lines)
