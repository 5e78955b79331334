"""The planner's check on its finalists: megalite's dry run (megalite.dryrun, one training
iteration of the first, middle and last pipeline stage on fake tensors) of each finalist's
launch flags, its measured peak memory per category beside the prediction for the same
pipeline rank. A finalist the dry run measures over the memory limit is dropped for the next
layout in the ranking.

`python -m megalite.planner.verify FLAGS...` is the child process: the fake CUDA device must
be in place before torch is imported, so each dry run is a process of its own; it prints one
JSON object per rank.
"""

import json
import subprocess
import sys

from megalite.planner.memory import rank_memory
from megalite.planner.report import memory_unit
from megalite.planner.search import Plan


def dry_run_flags(plan: Plan, prediction) -> list[str]:
    layout, workload = prediction.layout, plan.workload
    device = "cpu" if plan.cluster.slowdown or plan.cluster.measured else "cuda"
    return (workload.model_flags + ["--seq-length", str(workload.seq_length), "--global-batch-size",
                                    str(workload.global_batch_size)] + layout.flags()
            + ["--dry-run", "--dry-run-world-size", str(layout.world_size), "--dry-run-device", device,
               "--mock-data", "--lr", "1e-4", "--train-iters", "1"])


def measure(flags: list[str], timeout: float = 3600) -> list[dict]:
    """Per rank: {'rank', 'pp_rank', 'peak': {category: bytes}, 'peak_total'} from a dry run."""
    proc = subprocess.run([sys.executable, "-m", "megalite.planner.verify", *flags], capture_output=True,
                          text=True, timeout=timeout)
    if proc.returncode:
        tail = (proc.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise RuntimeError(f"dry run failed: {tail}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def verify(plan: Plan, count: int, dry_run=None) -> tuple[list, str]:
    """The dry run as the check on the finalists: dry-run the ranked layouts in order until
    `count` of them are measured to fit within plan.memory_limit on every rank measured. A layout
    whose measured peak is over the limit, or whose dry run fails, is dropped and the next one
    is tried. `dry_run(flags)` measures one layout (default: measure). Returns (the confirmed
    predictions, the report)."""
    dry_run = dry_run or measure
    unit, name = memory_unit(max(p.memory.total for p in plan.ranked[:count]))
    lines = [f"dry runs of the finalists (megalite.dryrun, MemTracker peak) against the prediction, {name}; "
             f"limit {plan.memory_limit / unit:.2f}:",
             f"{'layout':34} {'pp rank':>7} {'measured':>9} {'predicted':>9} {'error':>6}   measured by category"]
    confirmed = []
    for prediction in plan.ranked:
        if len(confirmed) == count:
            break
        short = prediction.layout.short()
        try:
            ranks = dry_run(dry_run_flags(plan, prediction))
        except (RuntimeError, subprocess.TimeoutExpired) as error:
            lines.append(f"{short:34} dropped: {error}")
            continue
        for rank in ranks:
            predicted = rank_memory(plan.workload, prediction.layout, rank["pp_rank"]).total
            measured = rank["peak_total"]
            parts = ", ".join(f"{k} {v / unit:.2f}" for k, v in rank["peak"].items())
            lines.append(f"{short:34} {rank['pp_rank']:>7} {measured / unit:>9.2f} "
                         f"{predicted / unit:>9.2f} {predicted / measured - 1:>+6.0%}   {parts}")
        peak = max((rank["peak_total"] for rank in ranks), default=None)
        if peak is None:
            lines.append(f"{short:34} dropped: the dry run measured no rank")
        elif peak > plan.memory_limit:
            lines.append(f"{short:34} dropped: measured peak {peak / unit:.2f} {name} is over the limit "
                         f"{plan.memory_limit / unit:.2f}")
        else:
            confirmed.append(prediction)
    if len(confirmed) < count:
        lines.append(f"{len(confirmed)} of the {len(plan.ranked)} simulated layouts confirmed by the dry run "
                     f"(asked for {count})")
    return confirmed, "\n".join(lines)


def _child(argv: list[str]) -> int:
    from megalite.dryrun.fake_cuda import fake_cuda_ready, reexec_with_fake_cuda
    from megalite.config.arguments import parse_args

    args = parse_args(argv)
    if args.dry_run_device == "cuda" and not fake_cuda_ready():
        reexec_with_fake_cuda(["-m", "megalite.planner.verify", *argv])  # does not return
    import torch

    from megalite.dryrun.runner import run_rank
    from megalite.dryrun.stages import first_middle_last
    from megalite.config.arguments import layout_from_args, validate_args
    from megalite.config.megatron.model import tokenizer_from_args

    world = args.dry_run_world_size
    validate_args(args, world)
    tokenizer = tokenizer_from_args(args)
    layout = layout_from_args(args, world)
    for rank in (layout.rank_of(0, 0, s) for s in first_middle_last(layout)):
        report = run_rank(args, tokenizer.vocab_size, rank, world, torch.device(args.dry_run_device))
        print(json.dumps({"rank": rank, "pp_rank": layout.coords(rank)[2], "peak": report.peak,
                          "peak_total": report.peak_total}), flush=True)
    return 0


if __name__ == "__main__":
    from megalite.dryrun.fake_cuda import exit_now

    exit_now(_child(sys.argv[1:]))
