"""Megatron's kernel-fusion, Transformer Engine, communication-schedule and logging switches
(the ones its MoE functional tests give): each leaves the model's math unchanged in Megatron,
so megalite accepts it with one start-up line saying how it serves it (`engine_notes`), or
refuses it by name where it cannot (`check_engine_args`). Nothing is accepted silently.
"""

import logging
from dataclasses import dataclass

from megalite.config.field import arg
from megalite.config.megatron.training import _check_cuda_graphs, cuda_graph_impl_of
from megalite.model.offload import OFFLOAD_MODULES

FLEX_BACKENDS = ("deepep", "hybridep", "ncclep")
# Megatron's --offload-modules megalite's layers do not have, and why
OFFLOAD_MODULES_NOT_HERE = {
    "fused_group_mlp": "Transformer Engine's fused grouped MLP (--use-transformer-engine-op-fuser), which megalite "
                       "does not have",
    "gdp_qkv": "the GatedDeltaProduct mixer, which megalite does not have"}


@dataclass
class MegatronEngineArgs:
    """Fusions, Transformer Engine switches, MoE communication schedules, logging level."""

    moe_permute_fusion: bool = arg(
        False, "Megatron: Transformer Engine's fused token permutation in the MoE dispatcher. megalite "
        "permutes with torch index operations (same rows, same order).")
    moe_router_fusion: bool = arg(
        False, "Megatron: Transformer Engine's fused top-k routing and auxiliary-loss kernels. megalite's "
        "router computes the same in plain torch.")
    moe_flex_dispatcher_backend: str = arg(
        "deepep", "Megatron: the kernels of --moe-token-dispatcher-type flex (DeepEP, HybridEP or NCCL EP, "
        "which need multi-GPU NVLink nodes). megalite serves flex with its all-to-all dispatcher.",
        choices=FLEX_BACKENDS)
    overlap_moe_expert_parallel_comm: bool = arg(
        False, "Megatron: overlap one micro-batch's expert-parallel all-to-alls with another's compute (a "
        "schedule; the math is unchanged). megalite runs them in order.")
    delay_wgrad_compute: bool = arg(
        False, "Megatron: with --overlap-moe-expert-parallel-comm, compute weight gradients after the "
        "data gradients (a schedule; the math is unchanged). megalite computes them together.")
    use_transformer_engine_op_fuser: bool = arg(
        False, "Megatron: Transformer Engine's operation fuser for some submodules. megalite uses its own "
        "kernels (same math).")
    te_rng_tracker: bool = arg(
        False, "Megatron: Transformer Engine's CUDA-graph-safe RNG tracker. megalite keeps its own tracker "
        "of the tensor-parallel RNG streams.")
    enable_experimental: bool = arg(
        False, "Megatron: let code marked experimental run. megalite gates no feature behind it.")
    logging_level: int | None = arg(
        None, "Level of the root Python logger (10 DEBUG, 20 INFO, 30 WARNING, 40 ERROR), as Megatron's.")
    no_use_layer_wise_param_layout: bool = arg(
        False, "Megatron: the legacy parameter layout of its layer-wise distributed optimizer (--optimizer "
        "dist_muon), which megalite does not have.")
    cuda_graph_modules: list[str] | None = arg(
        None, "Megatron's new name of --cuda-graph-scope (what the CUDA graphs capture): served as that.")
    fine_grained_activation_offloading: bool = arg(
        False, "Move what the --offload-modules save for backward to pinned CPU memory after their forward (on a "
        "side CUDA stream) and back before their backward (prefetched), as Megatron's.")
    offload_modules: list[str] | None = arg(
        None, f"The modules of --fine-grained-activation-offloading: {', '.join(OFFLOAD_MODULES)}.")
    min_offloaded_tensor_size: int = arg(
        1024 * 1024, "With --fine-grained-activation-offloading, saved tensors of fewer elements stay on the "
        "device (Megatron's default, 1M).")
    activation_offload_fraction: float = arg(
        1.0, "With --fine-grained-activation-offloading, after the first (warm-up) step only the first f of each "
        "micro-batch's offload groups (forward order, a fraction of groups, not bytes) still offload, in [0, 1].")
    delta_offload_bytes_across_pp_ranks: int = arg(
        0, "With --fine-grained-activation-offloading, pipeline rank r keeps r times this many bytes of its first "
        "offload groups on the device after the warm-up step.")
    fine_grained_offloading_max_inflight_offloads: int | None = arg(
        None, "With --fine-grained-activation-offloading, per module name and micro-batch, the compute stream "
        "waits for the offloads beyond the newest N (0: after each); unset: no waits.")
    delay_offload_until_cuda_graph: bool = arg(
        False, "Megatron: issue the expert offloads after a Transformer Engine CUDA graph's replay. megalite has "
        "no Transformer Engine CUDA graphs: refused.")
    outer_dp_sharding_strategy: str | None = arg(
        None, "Megatron-FSDP's hybrid sharding (HSDP): the outer data-parallel group's strategy, no_shard "
        "(Megatron's default) or optim. megalite has no HSDP, so only no_shard, which then changes nothing.",
        choices=("no_shard", "optim"))


def _renamed(fail):
    return lambda message: fail(message.replace("--cuda-graph-scope", "--cuda-graph-modules"))


def check_engine_args(args, fail) -> None:
    """Megatron's own refusals of these flags (TransformerConfig.__post_init__, validate_args),
    then what megalite cannot serve; fills --cuda-graph-scope from --cuda-graph-modules."""
    if args.cuda_graph_modules is not None:
        if args.cuda_graph_scope not in (None, list(args.cuda_graph_modules)):  # equal: validated before
            fail("--cuda-graph-modules and --cuda-graph-scope (its deprecated name) contradict each other (give one)")
        args.cuda_graph_scope = list(args.cuda_graph_modules)
        _check_cuda_graphs(args, _renamed(fail))
    if args.logging_level is not None and args.logging_level < 0:
        fail(f"--logging-level must not be negative, got {args.logging_level}")
    if args.moe_flex_dispatcher_backend == "ncclep" and args.moe_token_dispatcher_type != "flex":
        fail("--moe-flex-dispatcher-backend ncclep needs --moe-token-dispatcher-type flex (as in Megatron)")
    if args.moe_token_dispatcher_type == "flex" and args.moe_pad_expert_input_to_capacity \
            and args.moe_flex_dispatcher_backend == "deepep":
        fail("--moe-token-dispatcher-type flex with the deepep backend does not pad to capacity "
             "(--moe-pad-expert-input-to-capacity), as in Megatron")
    if args.overlap_moe_expert_parallel_comm:
        _check_expert_overlap(args, fail)
    if args.delay_wgrad_compute and not args.overlap_moe_expert_parallel_comm:
        fail("--delay-wgrad-compute needs --overlap-moe-expert-parallel-comm (as in Megatron)")
    if args.fine_grained_activation_offloading and not args.offload_modules:
        fail("--fine-grained-activation-offloading needs --offload-modules (as in Megatron; valid: "
             f"{', '.join(OFFLOAD_MODULES)})")
    if args.offload_modules:
        _check_offload_modules(args, fail)
    if args.delay_offload_until_cuda_graph:
        fail("--delay-offload-until-cuda-graph: defers the expert offloads to after a Transformer Engine CUDA "
             "graph's replay, which needs Transformer Engine CUDA graphs (--cuda-graph-impl transformer_engine); "
             "megalite has none")
    if (args.fine_grained_offloading_max_inflight_offloads or 0) < 0:
        fail("--fine-grained-offloading-max-inflight-offloads must not be negative, got "
             f"{args.fine_grained_offloading_max_inflight_offloads}")
    if args.outer_dp_sharding_strategy == "optim":
        fail("--outer-dp-sharding-strategy optim: Megatron-FSDP's hybrid sharding (HSDP) is not implemented in "
             "megalite (only no_shard, which without HSDP changes nothing)")


def _check_offload_modules(args, fail) -> None:
    """Megatron's refusals of --offload-modules (TransformerConfig.__post_init__), then megalite's."""
    for name in args.offload_modules:
        if name in OFFLOAD_MODULES_NOT_HERE:
            fail(f"--offload-modules {name}: offloads {OFFLOAD_MODULES_NOT_HERE[name]} (valid: "
                 f"{', '.join(OFFLOAD_MODULES)})")
        if name not in OFFLOAD_MODULES:
            fail(f"--offload-modules {name}: unknown module (valid: {', '.join(OFFLOAD_MODULES)})")
    if not args.fine_grained_activation_offloading:
        return  # Megatron ignores them then (a start-up line says so)
    modules, recomputed = set(args.offload_modules), set(args.recompute_modules or [])
    if "attn_proj" in modules and "core_attn" not in modules:
        fail("--offload-modules attn_proj needs core_attn too: the input of attn_proj is the output of core_attn, "
             "which core_attn's backward needs (as in Megatron)")
    if args.recompute_granularity == "selective" and "moe" in recomputed and modules & {"expert_fc1", "moe_act"}:
        fail("--offload-modules expert_fc1 / moe_act with --recompute-modules moe: the whole MoE layer is "
             "recomputed, nothing inside it is kept to offload (as in Megatron)")
    if args.min_offloaded_tensor_size < 0:
        fail(f"--min-offloaded-tensor-size must not be negative, got {args.min_offloaded_tensor_size}")
    if not 0 <= args.activation_offload_fraction <= 1:
        fail(f"--activation-offload-fraction must lie in [0, 1], got {args.activation_offload_fraction}")
    if args.delta_offload_bytes_across_pp_ranks < 0:
        fail(f"--delta-offload-bytes-across-pp-ranks must not be negative, got "
             f"{args.delta_offload_bytes_across_pp_ranks}")
    if args.recompute_granularity == "full":
        fail("--fine-grained-activation-offloading with --recompute-granularity full: whole layers are recomputed, "
             "nothing inside them is kept to offload")
    if args.torch_compile:
        fail("--fine-grained-activation-offloading with --torch-compile: the offload hooks on saved tensors "
             "run in eager mode only")
    if cuda_graph_impl_of(args) != "none":
        fail("--fine-grained-activation-offloading with CUDA graphs: megalite's local CUDA graphs capture whole "
             "layers, with which Megatron does not offload either")


def offload_model_fields(args) -> dict:
    """The GPTConfig fields of --fine-grained-activation-offloading."""
    if not args.fine_grained_activation_offloading:
        return {}
    return dict(offload_modules=tuple(args.offload_modules), min_offloaded_tensor_size=args.min_offloaded_tensor_size,
                activation_offload_fraction=args.activation_offload_fraction,
                delta_offload_bytes_across_pp_ranks=args.delta_offload_bytes_across_pp_ranks,
                offload_max_inflight=args.fine_grained_offloading_max_inflight_offloads)


def _offload_notes(args) -> list[str]:
    tuning = [(flag, value) for flag, value, default in (
        ("--activation-offload-fraction", args.activation_offload_fraction, 1.0),
        ("--delta-offload-bytes-across-pp-ranks", args.delta_offload_bytes_across_pp_ranks, 0),
        ("--fine-grained-offloading-max-inflight-offloads", args.fine_grained_offloading_max_inflight_offloads, None))
        if value != default]
    if not args.fine_grained_activation_offloading:
        given = ([f"--offload-modules {' '.join(args.offload_modules)}"] if args.offload_modules else []) + [
            f"{flag} {value}" for flag, value in tuning]
        return [f"{flag}: no effect without --fine-grained-activation-offloading (as in Megatron)" for flag in given]
    notes = [f"--fine-grained-activation-offloading: what {', '.join(args.offload_modules)} save for backward "
             f"(tensors of {args.min_offloaded_tensor_size} elements or more) is moved to CPU memory after their "
             "forward and back before their backward; after the first (warm-up) step the last group of each name "
             "stays on the device where its backward comes next, as in Megatron"
             + "".join(f", {flag} {value}" for flag, value in tuning)]
    if "core_attn" in args.offload_modules and args.recompute_granularity == "selective" \
            and "core_attn" in (args.recompute_modules or ["core_attn"]):
        notes.append("--offload-modules core_attn: core attention is recomputed (--recompute-modules core_attn), "
                     "so it keeps nothing to offload (as in Megatron)")
    return notes


def _check_expert_overlap(args, fail) -> None:
    """Megatron's asserts on --overlap-moe-expert-parallel-comm (transformer_config.py)."""
    modules = args.recompute_modules or []
    needs = [
        (args.expert_model_parallel_size > 1, "--expert-model-parallel-size > 1"),
        (args.moe_token_dispatcher_type in ("alltoall", "flex"), "--moe-token-dispatcher-type alltoall or flex"),
        (args.recompute_granularity != "full" and args.recompute_method is None
         and args.recompute_num_layers is None, "no full recompute (--recompute-granularity full, --recompute-method, "
                                                 "--recompute-num-layers)"),
        ("moe" not in modules, "no moe in --recompute-modules"),
        (args.bf16 or args.fp16, "--bf16 or --fp16"),
        (args.pipeline_model_parallel_size == 1 or args.num_layers_per_virtual_pipeline_stage is not None
         or args.num_virtual_stages_per_pipeline_rank is not None, "virtual pipeline stages at "
                                                                   "--pipeline-model-parallel-size > 1"),
        ((args.mtp_num_layers or 0) <= 1, "at most one --mtp-num-layers"),
    ]
    missing = [need for met, need in needs if not met]
    if missing:
        fail(f"--overlap-moe-expert-parallel-comm needs {missing[0]} (as in Megatron)")


def apply_logging_level(args) -> None:
    """--logging-level sets the root logger's level, as Megatron's initialize does."""
    if args.logging_level is not None:
        logging.getLogger().setLevel(args.logging_level)


def engine_notes(args) -> list[str]:
    """One start-up line per flag of this family that was given."""
    notes = []
    said = (
        ("moe_permute_fusion", "--moe-permute-fusion: megalite's dispatcher permutes tokens with torch index "
         "operations (no fused permutation kernel; the same rows in the same order)"),
        ("moe_router_fusion", "--moe-router-fusion: megalite's router computes the top-k and its losses in plain "
         "torch (Transformer Engine's fused router kernels not used; the same math)"),
        ("use_transformer_engine_op_fuser", "--use-transformer-engine-op-fuser: megalite's own kernels, Transformer "
         "Engine's operation fuser not used (the same math)"),
        ("te_rng_tracker", "--te-rng-tracker: megalite's own tracker of the tensor-parallel RNG streams, Transformer "
         "Engine's not used (dropout masks are drawn from other streams than Megatron's)"),
        ("enable_experimental", "--enable-experimental: megalite gates no feature behind Megatron's experimental "
         "switch (no effect)"),
        ("no_use_layer_wise_param_layout", "--no-use-layer-wise-param-layout: no effect without Megatron's layer-wise "
         "distributed optimizer (--optimizer dist_muon), which megalite does not have"),
    )
    notes += [line for name, line in said if getattr(args, name)] + _offload_notes(args)
    if args.logging_level is not None:
        notes.append(f"--logging-level {args.logging_level}: the root Python logger's level (megalite's "
                     f"{logging.getLevelName(args.logging_level)} and above are shown)")
    if args.moe_token_dispatcher_type == "flex":
        notes.append(f"--moe-token-dispatcher-type flex (--moe-flex-dispatcher-backend "
                     f"{args.moe_flex_dispatcher_backend}): served by megalite's all-to-all dispatcher (the same tokens "
                     "reach the same experts); DeepEP, HybridEP and NCCL EP kernels need multi-GPU NVLink nodes "
                     "and are not used")
    elif args.moe_flex_dispatcher_backend != "deepep":
        notes.append(f"--moe-flex-dispatcher-backend {args.moe_flex_dispatcher_backend}: no effect without "
                     "--moe-token-dispatcher-type flex (as in Megatron)")
    if args.overlap_moe_expert_parallel_comm:
        notes.append("--overlap-moe-expert-parallel-comm: megalite runs each micro-batch's expert-parallel "
                     "all-to-alls in order, without overlapping them with another micro-batch's compute (a "
                     "schedule; the math is unchanged)")
    if args.delay_wgrad_compute:
        notes.append("--delay-wgrad-compute: megalite computes weight gradients with the data gradients, not "
                     "delayed (a schedule; the math is unchanged)")
    if args.cuda_graph_modules is not None:
        notes.append("--cuda-graph-modules: Megatron's new name of --cuda-graph-scope, served as it"
                     + ("" if cuda_graph_impl_of(args) != "none" else " (the --cuda-graph-scope line says why it has "
                                                                      "no effect here)"))
    if args.outer_dp_sharding_strategy == "no_shard":
        notes.append("--outer-dp-sharding-strategy no_shard: Megatron's default, effective only with Megatron-FSDP's "
                     "hybrid sharding (HSDP), which megalite does not have (no effect)")
    return notes
