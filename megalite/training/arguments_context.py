"""Options for context parallelism (each sequence split over a group of ranks) and the rank
order of the parallel dimensions.

Names and defaults are Megatron-LM's. What megalite does not run yet (per-layer comm types,
hierarchical a2a+p2p, FSDP2 with CP) stops the
run naming the flag (check_context_args).
"""

from dataclasses import dataclass

from megalite.training.arguments_field import arg

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")
RUNNABLE_CP_COMM_TYPES = ("p2p", "all_gather", "a2a")


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
        "--cp-comm-type a2a+p2p.")
    use_tp_pp_dp_mapping: bool = arg(
        False, "Order ranks TP, CP, PP, DP (innermost first) instead of TP, CP, DP, PP.")


def cp_comm_type_of(args) -> str:
    """The one --cp-comm-type of the run (p2p when not given)."""
    return args.cp_comm_type[0] if args.cp_comm_type else "p2p"


def check_context_args(args, fail) -> None:
    """Refuse impossible options and what megalite cannot run yet, with one line naming the flag."""
    cp = args.context_parallel_size
    if cp < 1:
        fail(f"--context-parallel-size must be positive, got {cp}")
    if args.cp_comm_type is not None:
        for value in args.cp_comm_type:
            if value not in CP_COMM_TYPES:
                fail(f"--cp-comm-type {value!r}: expected one of {', '.join(CP_COMM_TYPES)}")
        if len(set(args.cp_comm_type)) > 1:
            fail(f"--cp-comm-type {' '.join(args.cp_comm_type)}: a different type per layer is not "
                 "implemented in megalite yet (give one)")
        if cp_comm_type_of(args) not in RUNNABLE_CP_COMM_TYPES:
            fail(f"--cp-comm-type {cp_comm_type_of(args)}: hierarchical context parallelism is not "
                 f"implemented in megalite yet ({', '.join(RUNNABLE_CP_COMM_TYPES)})")
    if args.hierarchical_context_parallel_sizes is not None:
        fail("--hierarchical-context-parallel-sizes: hierarchical context parallelism (a2a+p2p) is "
             "not implemented in megalite yet")
    if cp == 1:
        return
    checks = (
        (args.use_torch_fsdp2, f"--use-torch-fsdp2 with --context-parallel-size {cp} is not "
                               "implemented in megalite yet"),
        (args.use_flash_attn, f"--use-flash-attn with --context-parallel-size {cp} is not "
                              "implemented in megalite yet"),
        (getattr(args, "num_experts", None) is not None,
         f"--num-experts with --context-parallel-size {cp} is not implemented in megalite yet"),
    )
    for bad, message in checks:
        if bad:
            fail(message)
    split = 2 * cp * (args.tensor_model_parallel_size if args.sequence_parallel else 1)
    if args.seq_length is not None and args.seq_length % split:
        sp = " x --tensor-model-parallel-size (sequence parallelism)" if args.sequence_parallel else ""
        fail(f"--seq-length {args.seq_length} is not divisible by 2 x --context-parallel-size{sp} = {split}")
    heads = args.num_attention_heads // args.tensor_model_parallel_size if args.num_attention_heads else None
    if cp_comm_type_of(args) == "a2a" and heads is not None and heads % cp:
        fail(f"--cp-comm-type a2a needs --num-attention-heads {args.num_attention_heads} divisible by "
             f"--tensor-model-parallel-size {args.tensor_model_parallel_size} x --context-parallel-size {cp}")
