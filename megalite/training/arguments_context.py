"""Options for context parallelism (the sequence split over a group of ranks).

Names and defaults are Megatron-LM's. Until megalite implements context parallelism, any
value but the default stops the run naming the flag (check_context_args).
"""

from dataclasses import dataclass

from megalite.training.arguments_field import arg

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


@dataclass
class ContextArgs:
    """Context parallelism."""

    context_parallel_size: int = arg(1, "Context-parallel size: ranks each sequence is split over.")
    cp_comm_type: list[str] | None = arg(
        None, "Attention communication across the context-parallel group: p2p (ring), "
        "all_gather, a2a (Ulysses) or a2a+p2p (hierarchical); one value, or one per layer.")
    hierarchical_context_parallel_sizes: list[str] | None = arg(
        None, "Sizes of the a2a (inner) and p2p (outer) context-parallel groups with "
        "--cp-comm-type a2a+p2p.")


def check_context_args(args, fail) -> None:
    """Refuse what megalite cannot run yet, with one line naming the flag."""
    if args.context_parallel_size < 1:
        fail(f"--context-parallel-size must be positive, got {args.context_parallel_size}")
    if args.context_parallel_size > 1:
        fail(f"--context-parallel-size {args.context_parallel_size}: context parallelism is not "
             "implemented in megalite yet (only 1)")
    for name, value in (("--cp-comm-type", args.cp_comm_type),
                        ("--hierarchical-context-parallel-sizes", args.hierarchical_context_parallel_sizes)):
        if value is not None:
            fail(f"{name} needs context parallelism, which is not implemented in megalite yet")
