"""Options for mixtures of experts and expert parallelism.

Names and defaults are Megatron-LM's. Until megalite implements mixtures of experts, any value
but the default stops the run naming the flag (check_moe_args).
"""

from dataclasses import dataclass

from megalite.training.arguments_field import arg

TOKEN_DISPATCHERS = ("allgather", "alltoall", "flex")


@dataclass
class MoEArgs:
    """Mixture of experts."""

    num_experts: int | None = arg(None, "Experts per MoE layer (None: dense MLPs).")
    expert_model_parallel_size: int = arg(1, "Expert-parallel size: ranks the experts are split over.")
    expert_tensor_parallel_size: int | None = arg(
        None, "Tensor-parallel size inside each expert (default: --tensor-model-parallel-size).")
    moe_router_topk: int = arg(2, "Experts each token is routed to.")
    moe_token_dispatcher_type: str = arg(
        "allgather", "How tokens reach their experts' ranks.", choices=TOKEN_DISPATCHERS)


def check_moe_args(args, fail) -> None:
    """Refuse what megalite cannot run yet, with one line naming the flag."""
    if args.num_experts is not None:
        fail(f"--num-experts {args.num_experts}: mixtures of experts are not implemented in megalite yet")
    if args.expert_model_parallel_size != 1:
        fail(f"--expert-model-parallel-size {args.expert_model_parallel_size} needs --num-experts, "
             "and mixtures of experts are not implemented in megalite yet")
    if args.expert_tensor_parallel_size is not None:
        fail("--expert-tensor-parallel-size needs --num-experts, and mixtures of experts are not "
             "implemented in megalite yet")
    if args.moe_router_topk != 2:
        fail("--moe-router-topk needs --num-experts")
    if args.moe_token_dispatcher_type != "allgather":
        fail("--moe-token-dispatcher-type needs --num-experts")
