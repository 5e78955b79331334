"""Options for context parallelism (each sequence split over a group of ranks) and the rank
order of the parallel dimensions.

Names and defaults are Megatron-LM's. What megalite does not run yet stops the run naming the
flag (check_context_args).
"""

from dataclasses import dataclass

from megalite.config.field import arg
from megalite.config.flash_attn import uses_flash_attn_package

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


@dataclass
class ContextArgs:
    """Context parallelism."""

    context_parallel_size: int = arg(1, "Context-parallel size: ranks each sequence is split over "
                                        "(rank i holds chunks i and 2N-1-i of 2N).")
    cp_comm_type: list[str] | None = arg(
        None, "Attention communication across the context-parallel group: p2p (ring, the "
        "default), all_gather, a2a (Ulysses) or a2a+p2p (hierarchical); one value, or one per layer.")
    hierarchical_context_parallel_sizes: list[str] | None = arg(
        None, "Sizes of the a2a (inner) and p2p (outer) context-parallel groups with "
        "--cp-comm-type a2a+p2p (A x P = --context-parallel-size; a2a among A consecutive CP ranks).")
    use_tp_pp_dp_mapping: bool = arg(
        False, "Order ranks TP, CP, PP, DP (innermost first) instead of TP, CP, DP, PP.")


def cp_comm_types_of(args) -> list[str]:
    """The --cp-comm-type values of the run: one for every layer, or one per layer (p2p when
    not given)."""
    return list(args.cp_comm_type) if args.cp_comm_type else ["p2p"]


def cp_comm_type_of(args) -> str | tuple:
    """GPTConfig.cp_comm_type: the one type, or the tuple of one per layer."""
    types = cp_comm_types_of(args)
    return types[0] if len(types) == 1 else tuple(types)


def cp_a2a_size_of(args) -> int:
    """A of --hierarchical-context-parallel-sizes A P when some layer uses a2a+p2p, else 1."""
    if "a2a+p2p" not in cp_comm_types_of(args) or not args.hierarchical_context_parallel_sizes:
        return 1
    return int(args.hierarchical_context_parallel_sizes[0])


def _check_hierarchical(args, fail) -> None:
    cp, sizes = args.context_parallel_size, args.hierarchical_context_parallel_sizes
    hierarchical = "a2a+p2p" in cp_comm_types_of(args)
    if sizes is None:
        if hierarchical:
            fail("--cp-comm-type a2a+p2p needs --hierarchical-context-parallel-sizes A P")
        return
    try:
        values = [int(v) for v in sizes]
    except ValueError:
        fail(f"--hierarchical-context-parallel-sizes expects integers, got {' '.join(sizes)!r}")
    if len(values) != 2 or min(values) < 1:
        fail(f"--hierarchical-context-parallel-sizes {' '.join(sizes)}: expected two positive sizes, "
             "A (a2a, inner) and P (p2p, outer)")
    if values[0] * values[1] != cp:
        fail(f"--hierarchical-context-parallel-sizes {' '.join(sizes)}: {values[0]} x {values[1]} is not "
             f"--context-parallel-size {cp}")
    if not hierarchical:
        fail(f"--hierarchical-context-parallel-sizes is used only with --cp-comm-type a2a+p2p "
             f"(got {' '.join(cp_comm_types_of(args))})")


def check_context_args(args, fail) -> None:
    """Refuse impossible options and what megalite cannot run yet, with one line naming the flag."""
    cp = args.context_parallel_size
    if cp < 1:
        fail(f"--context-parallel-size must be positive, got {cp}")
    if args.cp_comm_type is not None:
        for value in args.cp_comm_type:
            if value not in CP_COMM_TYPES:
                fail(f"--cp-comm-type {value!r}: expected one of {', '.join(CP_COMM_TYPES)}")
        if args.num_layers is not None and len(args.cp_comm_type) not in (1, args.num_layers):
            fail(f"--cp-comm-type {' '.join(args.cp_comm_type)}: {len(args.cp_comm_type)} values for --num-layers "
                 f"{args.num_layers} (give one, or one per layer)")
    _check_hierarchical(args, fail)
    if cp == 1:
        return
    if uses_flash_attn_package(args) and args.attention_dropout > 0:
        fail(f"--use-flash-attn with --context-parallel-size {cp} needs --attention-dropout 0 (flash_attn's "
             "dropout masks cannot be the ones megalite's context-parallel dropout draws per block)")
    split = 2 * cp * (args.tensor_model_parallel_size if args.sequence_parallel else 1)
    if args.seq_length is not None and args.seq_length % split:
        sp = " x --tensor-model-parallel-size (sequence parallelism)" if args.sequence_parallel else ""
        fail(f"--seq-length {args.seq_length} is not divisible by 2 x --context-parallel-size{sp} = {split}")
    heads = args.num_attention_heads // args.tensor_model_parallel_size if args.num_attention_heads else None
    if "a2a" in cp_comm_types_of(args) and heads is not None and heads % cp:
        fail(f"--cp-comm-type a2a needs --num-attention-heads {args.num_attention_heads} divisible by "
             f"--tensor-model-parallel-size {args.tensor_model_parallel_size} x --context-parallel-size {cp}")
    a2a = cp_a2a_size_of(args)
    if "a2a+p2p" in cp_comm_types_of(args) and heads is not None and heads % a2a:
        fail(f"--cp-comm-type a2a+p2p needs --num-attention-heads {args.num_attention_heads} divisible by "
             f"--tensor-model-parallel-size {args.tensor_model_parallel_size} x the a2a size {a2a} of "
             "--hierarchical-context-parallel-sizes")
