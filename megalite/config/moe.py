"""Options for mixtures of experts and expert parallelism (Megatron's names, defaults and
meaning), the MoEConfig they describe, and their checks (check_moe_args)."""

from dataclasses import dataclass, fields

from megalite.model.moe_config import MoEConfig, parse_layer_freq
from megalite.parallel.expert.groups import ExpertLayout
from megalite.parallel.state import ParallelLayout
from megalite.config.field import arg, flag_of

TOKEN_DISPATCHERS = ("allgather", "alltoall", "flex")


@dataclass
class MoEArgs:
    """Mixture of experts."""

    num_experts: int | None = arg(None, "Experts per MoE layer (None: dense MLPs).")
    moe_ffn_hidden_size: int | None = arg(None, "Inner width of each expert (default: --ffn-hidden-size).")
    moe_layer_freq: str = arg(
        "1", "MoE layers: an integer N (layers 0, N, 2N, ... are MoE) or a list of 0/1 per layer "
        "such as '([0]+[1]*3)*2'.")
    expert_model_parallel_size: int = arg(1, "Expert-parallel size: ranks the experts are split over.")
    expert_tensor_parallel_size: int | None = arg(
        None, "Ranks each expert's weights are split over, independent of the attention's TP "
        "(default: --tensor-model-parallel-size); the ETP x EP grid tiles the TP x CP x DP ranks.")
    moe_router_topk: int = arg(2, "Experts each token is routed to.")
    moe_router_score_function: str = arg(
        "softmax", "Router score function.", choices=("softmax", "sigmoid", "sqrtsoftplus"),
        unsupported=("sqrtsoftplus",))
    moe_router_pre_softmax: bool = arg(False, "Softmax (or sigmoid) over all experts before the top-k.")
    moe_router_topk_scaling_factor: float | None = arg(None, "Multiplies the top-k routing probabilities.")
    moe_router_dtype: str | None = arg(None, "Dtype of the router logits and scores.", choices=("fp32", "fp64"))
    moe_router_num_groups: int | None = arg(None, "Expert groups for group-limited routing.")
    moe_router_group_topk: int | None = arg(None, "Groups each token may route to.")
    moe_router_load_balancing_type: str = arg(
        "aux_loss", "Load-balancing loss.",
        choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "quantile_balancing", "none"),
        unsupported=("quantile_balancing",))
    moe_aux_loss_coeff: float = arg(0.0, "Coefficient of the load-balancing loss.")
    moe_z_loss_coeff: float | None = arg(None, "Coefficient of the router z-loss.")
    moe_router_enable_expert_bias: bool = arg(
        False, "Auxiliary-loss-free balancing: a per-expert bias added to the scores for the top-k.")
    moe_router_bias_update_rate: float = arg(1e-3, "Step of the expert bias per optimizer step.")
    moe_expert_capacity_factor: float | None = arg(None, "Expert capacity factor (None: no dropping).")
    moe_pad_expert_input_to_capacity: bool = arg(False, "Pad each expert's input to its capacity.")
    moe_token_drop_policy: str = arg("probs", "Tokens dropped over capacity.", choices=("probs", "position"))
    moe_shared_expert_intermediate_size: int | None = arg(None, "Inner width of the shared expert.")
    moe_shared_expert_gate: bool = arg(False, "Gate the shared expert's output with sigmoid(x . w).")
    moe_grouped_gemm: bool = arg(False, "Local experts as one grouped matmul (torch._grouped_mm where "
                                        "the device has it, a loop of matmuls otherwise).")
    moe_token_dispatcher_type: str = arg(
        "allgather", "How tokens reach their experts' ranks (flex: Megatron's DeepEP/HybridEP kernels, served by "
        "megalite's alltoall dispatcher).", choices=TOKEN_DISPATCHERS)


def moe_config_from_args(args, ffn_hidden_size: int) -> MoEConfig | None:
    if args.num_experts is None:
        return None
    return MoEConfig(
        num_experts=args.num_experts, ffn_hidden_size=args.moe_ffn_hidden_size or ffn_hidden_size,
        layer_freq=parse_layer_freq(args.moe_layer_freq), router_topk=args.moe_router_topk,
        score_function=args.moe_router_score_function, pre_softmax=args.moe_router_pre_softmax,
        topk_scaling_factor=args.moe_router_topk_scaling_factor, router_dtype=args.moe_router_dtype,
        num_groups=args.moe_router_num_groups, group_topk=args.moe_router_group_topk,
        load_balancing_type=args.moe_router_load_balancing_type, aux_loss_coeff=args.moe_aux_loss_coeff,
        z_loss_coeff=args.moe_z_loss_coeff, enable_expert_bias=args.moe_router_enable_expert_bias,
        bias_update_rate=args.moe_router_bias_update_rate, capacity_factor=args.moe_expert_capacity_factor,
        pad_to_capacity=args.moe_pad_expert_input_to_capacity, token_drop_policy=args.moe_token_drop_policy,
        shared_expert_intermediate_size=args.moe_shared_expert_intermediate_size,
        shared_expert_gate=args.moe_shared_expert_gate, grouped_gemm=args.moe_grouped_gemm,
        token_dispatcher_type="alltoall" if args.moe_token_dispatcher_type == "flex" else args.moe_token_dispatcher_type)


def check_expert_width(args, fail) -> None:
    """Refuse experts whose width ETP does not split (after --ffn-hidden-size has its default)."""
    if args.num_experts is None:
        return
    etp = args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    ffn = args.moe_ffn_hidden_size or args.ffn_hidden_size
    if ffn % etp:
        fail(f"--moe-ffn-hidden-size {ffn} is not divisible by --expert-tensor-parallel-size {etp}")


def check_moe_args(args, fail, world_size: int | None = None) -> None:
    """Refuse what cannot run, with one line naming the flags."""
    if args.num_experts is None:
        changed = [flag_of(f) for f in fields(MoEArgs) if getattr(args, f.name) != f.default
                   and f.name != "expert_tensor_parallel_size"]
        if changed:
            fail(f"{changed[0]} needs --num-experts (mixture-of-experts layers)")
        _check_dense_expert_tensor_parallel(args, fail, world_size)
        return
    e, k = args.num_experts, args.moe_router_topk
    for name in ("num_experts", "moe_router_topk", "expert_model_parallel_size", "expert_tensor_parallel_size",
                 "moe_ffn_hidden_size",
                 "moe_router_num_groups", "moe_router_group_topk", "moe_shared_expert_intermediate_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            fail(f"{flag_of(next(f for f in fields(MoEArgs) if f.name == name))} must be positive, got {value}")
    for name in ("moe_aux_loss_coeff", "moe_z_loss_coeff", "moe_router_bias_update_rate",
                 "moe_expert_capacity_factor", "moe_router_topk_scaling_factor"):
        value = getattr(args, name)
        if value is not None and value < 0:
            fail(f"--{name.replace('_', '-')} must not be negative, got {value}")
    if k > e:
        fail(f"--moe-router-topk {k} is more than --num-experts {e}")
    if not args.disable_bias_linear:
        fail("--num-experts needs --disable-bias-linear (megalite's experts have no biases)")
    ep, etp = args.expert_model_parallel_size, args.expert_tensor_parallel_size or args.tensor_model_parallel_size
    if e % ep:
        fail(f"--num-experts {e} is not divisible by --expert-model-parallel-size {ep}")
    if world_size is not None:
        try:
            ExpertLayout(ParallelLayout(world_size, tensor=args.tensor_model_parallel_size,
                                        pipeline=args.pipeline_model_parallel_size,
                                        context=args.context_parallel_size, tp_pp_dp_mapping=args.use_tp_pp_dp_mapping),
                         ep, e, etp)
        except ValueError as err:
            fail(str(err))
    groups, group_topk = args.moe_router_num_groups, args.moe_router_group_topk
    if group_topk is not None:
        if groups is None:
            fail("--moe-router-group-topk needs --moe-router-num-groups")
        if e % groups or group_topk > groups or k % group_topk:
            fail(f"group-limited routing needs --num-experts {e} divisible by --moe-router-num-groups "
                 f"{groups}, --moe-router-group-topk {group_topk} <= groups and dividing --moe-router-topk {k}")
    _check_sinkhorn(args, fail)
    if args.moe_router_enable_expert_bias and args.moe_router_score_function != "sigmoid":
        fail("--moe-router-enable-expert-bias needs --moe-router-score-function sigmoid")
    if args.moe_pad_expert_input_to_capacity and args.moe_expert_capacity_factor is None:
        fail("--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor")
    if args.moe_shared_expert_gate and args.moe_shared_expert_intermediate_size is None:
        fail("--moe-shared-expert-gate needs --moe-shared-expert-intermediate-size")
    try:
        MoEConfig(num_experts=e, ffn_hidden_size=1, layer_freq=args.moe_layer_freq).layer_pattern(args.num_layers or 1)
    except ValueError as err:
        fail(str(err))


def _check_sinkhorn(args, fail) -> None:
    """Megatron's sinkhorn routing asserts a zero --moe-aux-loss-coeff and takes no score
    function, pre-softmax, scaling, grouping or expert bias (its own sigmoid for top-1, else
    softmax): megalite refuses those rather than ignore them."""
    if args.moe_router_load_balancing_type != "sinkhorn":
        return
    if args.moe_aux_loss_coeff:
        fail(f"--moe-router-load-balancing-type sinkhorn takes no --moe-aux-loss-coeff (got "
             f"{args.moe_aux_loss_coeff}; Megatron asserts it is 0)")
    ignored = [flag for flag, given in (
        ("--moe-router-score-function", args.moe_router_score_function != "softmax"),
        ("--moe-router-pre-softmax", args.moe_router_pre_softmax),
        ("--moe-router-topk-scaling-factor", args.moe_router_topk_scaling_factor is not None),
        ("--moe-router-group-topk", args.moe_router_group_topk is not None),
        ("--moe-router-enable-expert-bias", args.moe_router_enable_expert_bias)) if given]
    if ignored:
        fail(f"{ignored[0]} has no effect with --moe-router-load-balancing-type sinkhorn (its scores are "
             "sigmoid for top-1, else softmax, as in Megatron): give one of them")


def _check_dense_expert_tensor_parallel(args, fail, world_size: int | None) -> None:
    """--expert-tensor-parallel-size on a dense model: Megatron still builds its expert groups
    (megatron/core/parallel_state.py, initialize_model_parallel), so the world size must divide
    by ETP x EP x PP; the model has no experts, so nothing else changes (dense_expert_notes)."""
    etp = args.expert_tensor_parallel_size
    if etp is None:
        return
    if etp < 1:
        fail(f"--expert-tensor-parallel-size must be positive, got {etp}")
    span = etp * args.expert_model_parallel_size * args.pipeline_model_parallel_size
    if world_size is not None and world_size % span:
        fail(f"--expert-tensor-parallel-size {etp}: the world size {world_size} is not divisible by it x "
             f"--expert-model-parallel-size {args.expert_model_parallel_size} x --pipeline-model-parallel-size "
             f"{args.pipeline_model_parallel_size} = {span} (Megatron's expert groups need it)")


def dense_expert_notes(args) -> list[str]:
    """The start-up line for --expert-tensor-parallel-size on a model without experts."""
    if args.num_experts is None and args.expert_tensor_parallel_size is not None:
        return [f"--expert-tensor-parallel-size {args.expert_tensor_parallel_size}: no effect on a dense model "
                "(no --num-experts: there are no expert layers to split; Megatron accepts it there too)"]
    return []
