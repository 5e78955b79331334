"""Options for building a model's shards without the full model (meta-device construction) and
for dry runs on a fake device (`--dry-run`, megalite/dryrun/).

megalite's own options (Megatron has none of these).
"""

from dataclasses import dataclass

from megalite.config.field import MEGALITE, arg

DRY_RUN_DEVICES = ("cuda", "cpu")


@dataclass
class DryRunArgs:
    """Shard initialisation and dry runs."""

    init_on_shard: bool = arg(
        False, "Draw each tensor-parallel shard directly from (seed, parameter, TP rank) instead of "
        "slicing a full draw: no rank ever holds a full weight tensor, but the shards are then not "
        "slices of the TP=1 initialisation (a TP=2 run starts from different weights than TP=1).",
        origin=MEGALITE)
    dry_run: bool = arg(
        False, "In this one process, run one complete training iteration of a rank of each distinct "
        "pipeline stage (stages alike in layers, role and schedule are measured once; all virtual chunks) on "
        "fake tensors with a fake process group; print each stage's peak memory by category, bytes per "
        "process group, and a verdict: the highest peak, its stage, and whether it fits "
        "--dry-run-gpu-memory-gib. Exits 0 once measured, fitting or not; 1 naming the op, module and "
        "tensors when an op mixes devices or matmul dtypes. Needs no data files and no GPU.", origin=MEGALITE)
    dry_run_world_size: int | None = arg(
        None, "With --dry-run: the number of processes of the run to simulate (default: TP x CP x PP, "
        "times the expert-parallel size with --num-experts: the smallest world the layout needs).", origin=MEGALITE)
    dry_run_device: str = arg(
        "cuda", "With --dry-run: the fake device the run is simulated on (cpu to compare with CPU runs).",
        choices=DRY_RUN_DEVICES, origin=MEGALITE)
    dry_run_all_stages: bool = arg(
        False, "With --dry-run: measure every pipeline stage, also those alike in layers, role and schedule.",
        origin=MEGALITE)
    dry_run_gpu_memory_gib: float = arg(
        80.0, "With --dry-run: the GPU memory in GiB the verdict compares the highest peak with: FITS under 90% "
        "of it (the rest for the CUDA context, NCCL's buffers and fragmentation, which a dry run does not "
        "count), TIGHT under all of it, else DOES NOT FIT. Default 80: an 80 GB A100 or H100 as tools/plan.py's "
        "presets count it (an H100 80GB exposes 79.65).", origin=MEGALITE)


def check_dry_run_args(args, fail) -> None:
    """Refuse the dry-run options without --dry-run, and impossible sizes."""
    if not args.dry_run:
        for name, value, default in (("--dry-run-world-size", args.dry_run_world_size, None),
                                     ("--dry-run-device", args.dry_run_device, "cuda"),
                                     ("--dry-run-all-stages", args.dry_run_all_stages, False),
                                     ("--dry-run-gpu-memory-gib", args.dry_run_gpu_memory_gib, 80.0)):
            if value != default:
                fail(f"{name} needs --dry-run (a real run takes its world size from torchrun or srun)")
    if args.dry_run_world_size is not None and args.dry_run_world_size < 1:
        fail(f"--dry-run-world-size must be positive, got {args.dry_run_world_size}")
    if not args.dry_run_gpu_memory_gib > 0:
        fail(f"--dry-run-gpu-memory-gib must be positive, got {args.dry_run_gpu_memory_gib}")
