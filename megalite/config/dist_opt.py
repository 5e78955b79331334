"""Megatron's distributed-optimizer, Megatron-FSDP and tensor-parallel overlap flags.

Names and defaults are Megatron-LM's (megatron/training/arguments.py _add_distributed_args,
DistributedDataParallelConfig, ModelParallelConfig). Each changes what megalite runs:

  --num-distributed-optimizer-instances N   the distributed optimizer shards within N replicas
  --overlap-param-gather-with-optimizer-step  the first model chunk's all-gather during the
                                            other chunks' update
  --defer-embedding-wgrad-compute, --wgrad-deferral-limit
                                            the output layer's weight gradients at the flush
  --use-megatron-fsdp with --data-parallel-sharding-strategy and the three dtypes
                                            served by megalite's DDP, distributed optimizer
                                            and FSDP2 (`data_parallel_plan`)
  --tp-comm-overlap, --tp-comm-overlap-cfg  chunked / ring all-gathers and reduce-scatters
                                            overlapped with the TP GEMMs

`check_dist_opt_args` refuses what cannot run with one line naming the flag; `dist_opt_notes`
gives the start-up line for what is served another way.
"""

from dataclasses import dataclass

import torch
import yaml

from megalite.config.field import arg
from megalite.parallel.tensor.comm_overlap import kernel_settings_given, overlap_settings

SHARDING_STRATEGIES = ("no_shard", "optim", "optim_grads", "optim_grads_params")
FSDP_DTYPES = ("fp32", "bf16", "fp16", "auto")
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class DistOptArgs:
    """Distributed optimizer instances and overlaps, Megatron-FSDP, TP communication overlap."""

    num_distributed_optimizer_instances: int = arg(
        1, "Distributed-optimizer instances N: the optimizer state is sharded over DP x CP / N ranks and "
        "replicated N times; gradients are reduce-scattered within an instance, then all-reduced across.")
    overlap_param_gather_with_optimizer_step: bool = arg(
        False, "Update the first model chunk first and all-gather its parameters while the other chunks are "
        "updated (interleaved pipeline; needs --overlap-param-gather).")
    defer_embedding_wgrad_compute: bool = arg(
        False, "Compute the output layer's weight gradients after the last micro-batch's backward (in the "
        "pipeline flush) instead of in each backward (needs pipeline parallelism).")
    wgrad_deferral_limit: int = arg(
        0, "With --defer-embedding-wgrad-compute: defer only the first N micro-batches of a step (0: all).")
    use_megatron_fsdp: bool = arg(
        False, "Megatron-FSDP: served by megalite's data parallelism as --data-parallel-sharding-strategy says "
        "(no_shard: DDP; optim: the distributed optimizer; optim_grads: FSDP2 without resharding after "
        "forward; optim_grads_params: FSDP2).")
    data_parallel_sharding_strategy: str = arg(
        "optim_grads_params", "What --use-megatron-fsdp shards over the data-parallel ranks.",
        choices=SHARDING_STRATEGIES)
    megatron_fsdp_main_params_dtype: str = arg(
        "fp32", "Megatron-FSDP main parameters' dtype (auto: the model's); megalite keeps fp32 main parameters.",
        choices=FSDP_DTYPES)
    megatron_fsdp_main_grads_dtype: str = arg(
        "auto", "Megatron-FSDP main gradients' dtype (auto: the model parameters'): the gradient buffers "
        "under DDP and the distributed optimizer; FSDP2 keeps fp32 gradient shards.", choices=FSDP_DTYPES)
    megatron_fsdp_grad_comm_dtype: str = arg(
        "auto", "Megatron-FSDP gradient reduction dtype (auto: the main gradients'): FSDP2's reduce dtype; "
        "DDP and the distributed optimizer reduce their buffers in place, in the buffers' dtype.",
        choices=FSDP_DTYPES)
    tp_comm_overlap: bool = arg(
        False, "Overlap the tensor-parallel all-gathers and reduce-scatters of the qkv, proj, fc1 and fc2 GEMMs "
        "with the GEMMs, split in chunks or passed around the TP ring (needs --sequence-parallel).")
    tp_comm_overlap_cfg: str | None = arg(
        None, "YAML of Transformer Engine's userbuffer settings per GEMM (qkv_fprop: {method: ring_exchange}, "
        "proj_fprop: {method: pipeline, num_splits: 4}, ...); megalite reads method and num_splits.")


@dataclass(frozen=True)
class DataParallelPlan:
    """How the data-parallel ranks share the model, after --use-megatron-fsdp is resolved."""

    fsdp2: bool
    fsdp2_reshard_after_forward: bool
    distributed_optimizer: bool
    grad_dtype: torch.dtype | None  # DDP buffers' dtype; None: ParallelConfig's rule (--bf16 ... flags)
    fsdp2_reduce_dtype: torch.dtype


def _model_dtype(args) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "fp32"


def data_parallel_plan(args) -> DataParallelPlan:
    """--use-torch-fsdp2 / --use-distributed-optimizer, or --use-megatron-fsdp's strategy and
    dtypes served by them (checked by check_dist_opt_args)."""
    if not args.use_megatron_fsdp:
        return DataParallelPlan(args.use_torch_fsdp2, True, args.use_distributed_optimizer, None, torch.float32)
    strategy = args.data_parallel_sharding_strategy
    fsdp2 = strategy in ("optim_grads", "optim_grads_params")
    # "auto": the model's dtype; megalite's FSDP2 model holds fp32 parameters (it computes in 16 bits)
    grads = args.megatron_fsdp_main_grads_dtype
    grads = ("fp32" if fsdp2 else _model_dtype(args)) if grads == "auto" else grads
    comm = args.megatron_fsdp_grad_comm_dtype
    comm = grads if comm == "auto" else comm
    return DataParallelPlan(fsdp2, strategy == "optim_grads_params", strategy == "optim",
                            None if fsdp2 else _DTYPES[grads], _DTYPES[comm])


def tp_comm_overlap_settings(args) -> dict | None:
    """The per-GEMM overlap settings of --tp-comm-overlap (None without it, and with --fp8-format, whose
    GEMMs the overlapped chunks do not run: megalite/config/fp8.py's start-up line says so)."""
    if not args.tp_comm_overlap or args.fp8_format is not None:
        return None
    return overlap_settings(_read_cfg(args.tp_comm_overlap_cfg), args.tp_comm_overlap_cfg or "defaults")


def _read_cfg(path: str | None):
    if path is None:
        return None
    try:
        with open(path, encoding="utf-8") as handle:
            return yaml.safe_load(handle)
    except OSError as error:
        raise ValueError(f"--tp-comm-overlap-cfg {path}: cannot read it ({error.strerror})") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        raise ValueError(f"{path}{f':{mark.line + 1}' if mark else ''}: not valid YAML") from None


def check_dist_opt_args(args, fail, layout) -> None:
    """Refuse, with one line naming the flag, what megalite (or Megatron) cannot run
    (`layout`: the run's ParallelLayout, which already checked that N divides DP x CP)."""
    n = args.num_distributed_optimizer_instances
    plan = data_parallel_plan(args)
    if n > 1 and args.num_experts:
        etp = args.expert_tensor_parallel_size or layout.tensor
        edp = layout.tensor * layout.context * layout.data // (etp * args.expert_model_parallel_size)
        if edp % n:
            fail(f"--num-distributed-optimizer-instances {n} does not divide the expert-data-parallel size {edp} "
                 "(Megatron splits it into instances as it splits DP x CP)")
    if n > 1 and plan.fsdp2:
        fail(f"--num-distributed-optimizer-instances {n} with FSDP2 (Megatron-FSDP's hybrid sharding) is not "
             "implemented; use --data-parallel-sharding-strategy optim or the distributed optimizer")
    if n > 1 and not plan.distributed_optimizer:
        fail(f"--num-distributed-optimizer-instances {n} needs --use-distributed-optimizer (the instances are "
             "its shards)")
    if args.optimizer_cpu_offload and not plan.distributed_optimizer:
        fail("--optimizer-cpu-offload needs --use-distributed-optimizer")
    if args.overlap_param_gather_with_optimizer_step:
        if not plan.distributed_optimizer or not args.overlap_param_gather:
            fail("--overlap-param-gather-with-optimizer-step needs --use-distributed-optimizer and "
                 "--overlap-param-gather")
        if layout.virtual_pipeline == 1:
            fail("--overlap-param-gather-with-optimizer-step needs virtual pipeline stages (as in Megatron: the "
                 "first model chunk's all-gather overlaps the other chunks' update)")
    if args.gradient_accumulation_fusion and plan.fsdp2:
        fail("--gradient-accumulation-fusion: FSDP2 has no main_grad buffers to accumulate into (Megatron refuses "
             "it with --use-torch-fsdp2 too); give --no-gradient-accumulation-fusion or neither")
    _check_deferral(args, fail, plan)
    _check_megatron_fsdp(args, fail, plan)
    _check_tp_comm_overlap(args, fail)


def _check_deferral(args, fail, plan) -> None:
    if args.wgrad_deferral_limit < 0:
        fail(f"--wgrad-deferral-limit must not be negative, got {args.wgrad_deferral_limit}")
    if not args.defer_embedding_wgrad_compute:
        return
    if args.pipeline_model_parallel_size == 1:
        fail("--defer-embedding-wgrad-compute needs --pipeline-model-parallel-size > 1 (as in Megatron: the "
             "deferred GEMMs fill the pipeline flush)")
    if plan.fsdp2:
        fail("--defer-embedding-wgrad-compute is implemented for megalite's DDP and distributed optimizer, "
             "not FSDP2")
    if args.pipeline_schedule == "zb_h1":
        fail("--defer-embedding-wgrad-compute and --pipeline-schedule zb_h1 contradict each other (zb_h1 "
             "defers every weight gradient itself)")


def _check_megatron_fsdp(args, fail, plan) -> None:
    given = [f"--{n.replace('_', '-')}" for n in ("megatron_fsdp_main_params_dtype", "megatron_fsdp_main_grads_dtype",
                                                  "megatron_fsdp_grad_comm_dtype")]
    if args.ckpt_format == "fsdp_dtensor" and not args.use_megatron_fsdp:
        fail("--ckpt-format fsdp_dtensor needs --use-megatron-fsdp (as in Megatron); without it use torch_dist")
    if not args.use_megatron_fsdp:
        return
    if args.use_torch_fsdp2:
        fail("--use-megatron-fsdp and --use-torch-fsdp2 contradict each other (give one)")
    params = args.megatron_fsdp_main_params_dtype
    if params == "auto" and not plan.fsdp2:
        params = _model_dtype(args)
    if params not in ("fp32", "auto"):
        fail(f"{given[0]} {args.megatron_fsdp_main_params_dtype}: megalite keeps fp32 main parameters (give fp32)")
    grads, reduce_dtype = args.megatron_fsdp_main_grads_dtype, plan.fsdp2_reduce_dtype
    if plan.fsdp2 and grads not in ("fp32", "auto"):
        fail(f"{given[1]} {grads}: FSDP2 (--data-parallel-sharding-strategy {args.data_parallel_sharding_strategy}) "
             "keeps fp32 gradient shards (give fp32 or auto)")
    if not plan.fsdp2:
        model = _DTYPES[_model_dtype(args)]
        if plan.grad_dtype not in (torch.float32, model):
            fail(f"{given[1]} {grads}: the gradient buffers hold fp32 or the model's {_model_dtype(args)}")
        if reduce_dtype != plan.grad_dtype:
            fail(f"{given[2]} {args.megatron_fsdp_grad_comm_dtype}: with --data-parallel-sharding-strategy "
                 f"{args.data_parallel_sharding_strategy} megalite reduces the gradient buffers in place, in their "
                 f"own dtype ({given[1]})")
        if args.grad_reduce_in_bf16 and plan.grad_dtype != torch.bfloat16:
            fail(f"--grad-reduce-in-bf16 and {given[1]} contradict each other (give one)")
    elif args.grad_reduce_in_bf16:
        fail(f"--grad-reduce-in-bf16 applies to megalite's DistributedDataParallel, not FSDP2 (--data-parallel-"
             f"sharding-strategy {args.data_parallel_sharding_strategy}); give {given[2]} bf16")


def _check_tp_comm_overlap(args, fail) -> None:
    if not args.tp_comm_overlap:
        return
    if not args.sequence_parallel or args.tensor_model_parallel_size == 1:
        fail("--tp-comm-overlap needs --sequence-parallel at --tensor-model-parallel-size > 1 (as in Megatron: "
             "it overlaps the sequence-parallel all-gathers and reduce-scatters)")
    if args.torch_compile:
        fail("--tp-comm-overlap and --torch-compile contradict each other (the overlap's collectives run outside "
             "the compiled graph; give one)")
    try:
        tp_comm_overlap_settings(args)
    except ValueError as error:
        fail(str(error))


def dist_opt_notes(args) -> list[str]:
    """One start-up line for each of these flags that megalite serves another way or that has
    no effect here."""
    notes = []
    if args.gradient_accumulation_fusion is None and data_parallel_plan(args).fsdp2:
        notes.append("gradient accumulation fusion (Megatron's default): off under FSDP2, which has no main_grad "
                     "buffers; weight gradients go through .grad")
    elif args.gradient_accumulation_fusion is not False and args.torch_compile:
        notes.append("gradient accumulation fusion: not inside the --torch-compile regions (their linears hand "
                     "autograd the weight gradient, which DDP adds to main_grad)")
    if args.wgrad_deferral_limit and not args.defer_embedding_wgrad_compute:
        notes.append(f"--wgrad-deferral-limit {args.wgrad_deferral_limit}: no effect without "
                     "--defer-embedding-wgrad-compute (Megatron ignores it there too)")
    if args.tp_comm_overlap_cfg and not args.tp_comm_overlap:
        notes.append("--tp-comm-overlap-cfg: no effect without --tp-comm-overlap (Megatron reads it only then)")
    if args.tp_comm_overlap and args.tp_comm_overlap_cfg:
        tuned = kernel_settings_given(_read_cfg(args.tp_comm_overlap_cfg))
        if tuned:
            notes.append(f"--tp-comm-overlap-cfg: {', '.join(tuned)} tune Transformer Engine's userbuffer kernels; "
                         "megalite overlaps with torch.distributed collectives and reads method and num_splits only")
    if args.use_megatron_fsdp:
        plan = data_parallel_plan(args)
        served = ("FSDP2 (ZeRO-3)" if plan.fsdp2_reshard_after_forward else
                  "FSDP2 without resharding after forward (ZeRO-2)") if plan.fsdp2 else \
            "the distributed optimizer (ZeRO-1)" if plan.distributed_optimizer else "DistributedDataParallel"
        notes.append(f"--use-megatron-fsdp --data-parallel-sharding-strategy {args.data_parallel_sharding_strategy}: "
                     f"served by megalite's {served}")
        if args.overlap_param_gather and not plan.distributed_optimizer:
            notes.append("--overlap-param-gather: " + ("FSDP2 prefetches its parameter all-gathers during the forward "
                                                       "itself" if plan.fsdp2 else "no effect with no_shard, which "
                                                       "gathers no parameters"))
        if args.ckpt_format == "fsdp_dtensor":
            notes.append("--ckpt-format fsdp_dtensor: megalite writes its torch_dist (DCP) checkpoints, sharded "
                         "the same way and resharding on load")
    return notes
