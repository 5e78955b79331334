"""Megatron-LM's training-loop flags that its example scripts and functional tests set.

Names and defaults are Megatron-LM's (megatron/training/config/training_config.py,
arguments.py). `check_megatron_training_args` refuses what megalite cannot do with one line
naming the flag; `megatron_training_notes` gives the one start-up line for each flag megalite
serves another way.
"""

from dataclasses import dataclass

from megalite.parallel.pipeline.schedules import validate_schedule
from megalite.config.field import arg, on_cpu
from megalite.config.pipeline_layout import layout_counts
from megalite.config.schedules import batch_schedule_from_args

RERUN_MODES = ("disabled", "validate_results", "report_stats")
CUDA_GRAPH_IMPLS = ("none", "local", "transformer_engine")
CUDA_GRAPH_SCOPES = ("full", "attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full_iteration",
                     "full_iteration_inference")


@dataclass
class MegatronTrainingArgs:
    """Megatron's training-loop options."""

    calculate_per_token_loss: bool = arg(
        False, "Average the loss over every non-masked token of the global batch (all micro-batches "
        "and data-parallel replicas together) instead of averaging per-micro-batch means.")
    decoupled_lr: float | None = arg(
        None, "Peak learning rate of the word embedding and the output layer (their own group; "
        "warmup and decay follow the main schedule).")
    decoupled_min_lr: float | None = arg(
        None, "Minimum learning rate of the word embedding and output layer (default --min-lr).")
    step_batch_size_schedule: str | None = arg(
        None, "Step-wise global batch size 'THRESHOLD:B THRESHOLD:B ...' (thresholds in tokens, "
        "suffixes K M B T; the first 0); replaces --global-batch-size. With --train-iters, the lr "
        "schedule's iterations count --micro-batch-size x DP samples each, as Megatron counts them.")
    eval_global_batch_size: int | None = arg(
        None, "Sequences per evaluation step (default --global-batch-size).")
    manual_gc: bool = arg(
        False, "Disable Python's automatic garbage collector; collect at evaluation and every "
        "--manual-gc-interval iterations instead, at the same point on every rank.")
    manual_gc_interval: int = arg(0, "Iterations between manual collections (0: none in training).")
    manual_gc_eval: bool | None = arg(
        True, "With --manual-gc, collect at the start and end of each evaluation.",
        negative_flag="--no-manual-gc-eval")
    empty_unused_memory_level: int = arg(
        0, "Return cached CUDA memory to the device: 0 never, 1 after each training step, 2 also "
        "after each evaluation step (no effect on CPU).", choices=(0, 1, 2))
    grad_reduce_in_bf16: bool = arg(
        False, "Keep the data-parallel gradient buffers, and reduce them, in bfloat16 (with --bf16).")
    ddp_average_in_collective: bool = arg(
        False, "Average gradients inside the data-parallel collective instead of pre-scaling.")
    deterministic_mode: bool = arg(
        False, "Deterministic algorithms only (torch.use_deterministic_algorithms), so that a "
        "repeated run gives bit-identical results.")
    microbatch_group_size_per_virtual_pipeline_stage: int | None = arg(
        None, "Micro-batches run on one virtual stage before moving to the next (interleaved "
        "schedule; from the pipeline size to the micro-batches per step; default the pipeline size).")
    account_for_embedding_in_pipeline_split: bool = arg(
        False, "Count the embedding as one layer when splitting layers over pipeline stages (the "
        "first stage gets one transformer layer fewer).")
    account_for_loss_in_pipeline_split: bool = arg(
        False, "Count the loss as one layer when splitting layers over pipeline stages (the last "
        "stage gets one transformer layer fewer).")
    overlap_p2p_comm: bool | None = arg(
        None, "Overlap pipeline transfers with compute (Megatron's interleaved-schedule option).",
        flag="--overlap-p2p-communication", negative_flag="--no-overlap-p2p-communication")
    overlap_p2p_communication_warmup_flush: bool = arg(
        False, "Also overlap pipeline transfers in the warm-up and flush of the interleaved schedule.")
    check_weight_hash_across_dp_replicas_interval: int | None = arg(
        None, "Every this many iterations, check that every data-parallel replica holds "
        "bit-identical weights; stop naming the differing ranks if not.")
    rerun_mode: str = arg(
        "validate_results", "validate_results: from a job's second iteration on, a step whose loss is NaN or "
        "infinite is re-run on the same micro-batches with the same random state, as Megatron does: not "
        "reproduced, the run stops (exit 17, a possible transient fault); reproduced, it saves a checkpoint "
        "and stops (exit 16) so that a job resumed on another device tells a persistent fault (exit 17) "
        "from a correct result. report_stats: every step runs twice and the differences are reported every --log-interval. "
        "disabled: nothing is re-run (--check-for-nan-in-loss-and-grad still stops at a NaN step).",
        choices=RERUN_MODES)
    check_for_nan_in_loss_and_grad: bool | None = arg(
        True, "Stop the run at a step whose gradients hold a NaN or Inf (its update not applied), as Megatron "
        "does; off, such a step is skipped and counted. Off by itself with --fp16's dynamic loss scaling, "
        "where such steps lower the scale.", negative_flag="--no-check-for-nan-in-loss-and-grad")
    error_injection_rate: int = arg(
        0, "Reject one in this many result validations on purpose (0: none), as Megatron's fault injection "
        "does, to exercise --rerun-mode validate_results; each loss-computing rank validates each micro-batch's "
        "loss twice (NaN and Inf), at most one rejection per iteration.")
    error_injection_type: str = arg(
        "transient_error", "What an injected rejection behaves like when re-run: transient_error (the re-run "
        "differs), persistent_error (reproduced in place, differs on another device), correct_result "
        "(reproduced everywhere).", choices=("correct_result", "transient_error", "persistent_error"))
    profile: bool = arg(
        False, "Profile iterations --profile-step-start to --profile-step-end with torch.profiler "
        "(a Chrome trace per profiled rank in --tensorboard-dir, else <save>/profile).")
    use_pytorch_profiler: bool = arg(
        False, "Megatron's switch from nsys to torch.profiler; megalite's --profile always uses "
        "torch.profiler.")
    profile_step_start: int = arg(10, "First profiled iteration.")
    profile_step_end: int = arg(12, "Profiling stops before this iteration.")
    profile_ranks: list[str] | None = arg(None, "Global ranks to profile (default 0).")
    test_mode: bool = arg(
        False, "Megatron's real-time consistency test: before every iteration the query and key layernorm "
        "weights (--qk-layernorm) are compared across data- and tensor-parallel ranks; a difference stops "
        "the run naming the layer and ranks.")
    disable_gloo_process_groups: bool = arg(
        False, "Create no Gloo process groups beside the backend's (Megatron's CPU-side groups for its "
        "distributed optimizer's legacy checkpoints).")
    global_batch_size_from_schedule: bool = arg(
        False, "--global-batch-size was filled from --step-batch-size-schedule.", cli=False)
    cuda_graph_impl: str = arg(
        "none", "CUDA graphs of the training step. local: megalite's own, each transformer layer's forward "
        "and backward captured once with torch.cuda.make_graphed_callables after --cuda-graph-warmup-steps "
        "eager steps, then replayed (no host work per kernel). transformer_engine needs Transformer Engine, "
        "which megalite does without.", choices=CUDA_GRAPH_IMPLS)
    cuda_graph_scope: list[str] | None = arg(
        None, "What the CUDA graphs capture: none given (or full) captures whole transformer layers, the one "
        f"scope megalite serves; Megatron's others ({', '.join(CUDA_GRAPH_SCOPES[1:])}) are refused.")
    cuda_graph_warmup_steps: int = arg(3, "Training steps run eagerly before the CUDA graphs are captured.")
    enable_cuda_graph: bool = arg(False, "Deprecated: --cuda-graph-impl local.")
    external_cuda_graph: bool = arg(False, "Deprecated: --cuda-graph-impl transformer_engine.")


def _int_list(name: str, values, fail) -> list[int]:
    try:
        return [int(v) for v in values]
    except ValueError:
        fail(f"--{name.replace('_', '-')} expects integers, got {' '.join(values)!r}")


def check_megatron_training_args(args, world_size: int, fail) -> None:
    """Refuse, with one line naming the flag, what megalite cannot do; fills nothing."""
    for name in ("decoupled_lr", "decoupled_min_lr"):
        value = getattr(args, name)
        if value is not None and value < 0:
            fail(f"--{name.replace('_', '-')} must not be negative, got {value}")
    if args.decoupled_min_lr is not None and args.decoupled_lr is None:
        fail("--decoupled-min-lr needs --decoupled-lr")
    if args.decoupled_lr is not None and args.decoupled_lr < (args.decoupled_min_lr or args.min_lr):
        fail(f"--decoupled-lr {args.decoupled_lr} is smaller than its minimum learning rate")
    for name in ("manual_gc_interval", "error_injection_rate"):
        if getattr(args, name) < 0:
            fail(f"--{name.replace('_', '-')} must not be negative, got {getattr(args, name)}")
    for name in ("eval_global_batch_size", "check_weight_hash_across_dp_replicas_interval",
                 "microbatch_group_size_per_virtual_pipeline_stage"):
        value = getattr(args, name)
        if value is not None and value <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.grad_reduce_in_bf16 and not args.bf16:
        fail("--grad-reduce-in-bf16 needs --bf16 (megalite keeps fp16 and fp32 runs' gradients "
             "in their own precision)")
    if args.grad_reduce_in_bf16 and args.use_torch_fsdp2:
        fail("--grad-reduce-in-bf16 applies to megalite's DistributedDataParallel, not --use-torch-fsdp2")
    if args.profile:
        if args.profile_step_end <= args.profile_step_start or args.profile_step_start < 0:
            fail(f"--profile-step-end {args.profile_step_end} must be larger than "
                 f"--profile-step-start {args.profile_step_start} (>= 0)")
        if not args.tensorboard_dir and not args.save:
            fail("--profile writes its traces to --tensorboard-dir (or <save>/profile): give one")
        ranks = _int_list("profile_ranks", args.profile_ranks or ["0"], fail)
        if any(not 0 <= r < world_size for r in ranks):
            fail(f"--profile-ranks {' '.join(map(str, ranks))}: ranks run from 0 to {world_size - 1}")
    elif args.profile_ranks is not None:
        fail("--profile-ranks needs --profile")
    _check_batch_schedule(args, fail)
    _check_cuda_graphs(args, fail)


def cuda_graph_impl_of(args) -> str:
    """--cuda-graph-impl, or what a deprecated --enable-cuda-graph / --external-cuda-graph stands for."""
    if args.enable_cuda_graph:
        return "local"
    return "transformer_engine" if args.external_cuda_graph else args.cuda_graph_impl


def cuda_graph_scope_of(args) -> tuple[str, ...]:
    """--cuda-graph-scope as Megatron normalises it: () for whole layers (none given, or full)."""
    return tuple(s for s in args.cuda_graph_scope or () if s != "full")


def _check_cuda_graphs(args, fail) -> None:
    """Megatron's refusals first (TransformerConfig.__post_init__, validate_args), then what
    megalite's local graphs cannot capture."""
    if (args.enable_cuda_graph or args.external_cuda_graph) and args.cuda_graph_impl != "none":
        fail("--enable-cuda-graph / --external-cuda-graph (deprecated) and --cuda-graph-impl contradict each "
             "other: give --cuda-graph-impl alone")
    if args.enable_cuda_graph and args.external_cuda_graph:
        fail("--enable-cuda-graph and --external-cuda-graph contradict each other (give one)")
    scope = args.cuda_graph_scope or []
    if unknown := [s for s in scope if s not in CUDA_GRAPH_SCOPES]:
        fail(f"--cuda-graph-scope {unknown[0]}: unknown scope (choose from {', '.join(CUDA_GRAPH_SCOPES)})")
    if "full" in scope and len(scope) > 1:
        fail("--cuda-graph-scope full (the whole layer) cannot be combined with other scopes")
    impl = cuda_graph_impl_of(args)
    if impl == "none":
        return
    if impl == "transformer_engine" and "full_iteration" in scope:
        fail("--cuda-graph-scope full_iteration needs --cuda-graph-impl local, not transformer_engine")
    if "moe" in scope and "moe_router" in scope:
        fail("--cuda-graph-scope must not contain both moe and moe_router")
    if "moe_preprocess" in scope and "moe_router" not in scope and impl != "local":
        fail("--cuda-graph-scope moe_preprocess needs moe_router as well")
    if args.num_experts is None and {"moe", "moe_router", "moe_preprocess"} & set(scope):
        fail("--cuda-graph-scope moe / moe_router capture MoE layers: they need --num-experts")
    if args.recompute_granularity == "full" and scope != ["full_iteration"]:
        fail("--recompute-granularity full with CUDA graphs needs --cuda-graph-scope full_iteration (as in Megatron)")
    if impl == "transformer_engine":
        fail("--cuda-graph-impl transformer_engine (or --external-cuda-graph) needs Transformer Engine, which "
             "megalite does not use: give --cuda-graph-impl local")
    _check_local_graphs(args, fail)


def _check_local_graphs(args, fail) -> None:
    scope = cuda_graph_scope_of(args)
    if scope:
        fail(f"--cuda-graph-scope {' '.join(scope)}: megalite's local CUDA graphs capture whole transformer layers "
             "only (give no --cuda-graph-scope, or full)")
    if args.cuda_graph_warmup_steps < 1:
        fail(f"--cuda-graph-warmup-steps {args.cuda_graph_warmup_steps}: megalite's local CUDA graphs take their "
             "static shapes from an eager step, so at least 1")
    limits = [
        (args.recompute_granularity, f"--recompute-granularity {args.recompute_granularity} (recompute inside a "
                                     "graphed layer saves and restores RNG states, which a capture cannot hold)"),
        (args.attention_dropout > 0, f"--attention-dropout {args.attention_dropout} (it draws from the tensor-"
                                     "parallel RNG stream by swapping generator states, which a capture cannot "
                                     "hold: give --attention-dropout 0)"),
        (args.hidden_dropout > 0 and args.sequence_parallel,
         "--hidden-dropout with --sequence-parallel (it draws from the tensor-parallel RNG stream; give "
         "--hidden-dropout 0)"),
        (args.pipeline_model_parallel_size > 1, "--pipeline-model-parallel-size > 1 (a graphed layer holds one "
                                                "micro-batch's activations; the pipeline keeps several in flight)"),
        (args.pipeline_schedule not in (None, "none"), f"--pipeline-schedule {args.pipeline_schedule} (it runs "
                                                       "several micro-batches' forwards before their backwards)"),
        (args.context_parallel_size > 1, "--context-parallel-size > 1"),
        (args.num_experts is not None, "--num-experts (MoE routing sends a data-dependent number of tokens to "
                                       "each expert, shapes a graph cannot hold)"),
        (args.use_torch_fsdp2, "--use-torch-fsdp2 (its hooks gather parameters around each layer)"),
        (args.overlap_param_gather, "--overlap-param-gather (its forward pre-hooks wait for parameters)"),
        (on_cpu(args), "a CPU run (CUDA graphs need CUDA)"),
    ]
    for refused, what in limits:
        if refused:
            fail(f"--cuda-graph-impl local is not available with {what}")


def _check_batch_schedule(args, fail) -> None:
    given = [f for f, v in (("--rampup-batch-size", args.rampup_batch_size),
                            ("--step-batch-size-schedule", args.step_batch_size_schedule)) if v is not None]
    if len(given) == 2:
        fail("--rampup-batch-size and --step-batch-size-schedule contradict each other (give one)")
    if not given:
        return
    if args.rampup_batch_size is not None and args.train_samples is None:
        fail("--rampup-batch-size needs --train-samples (Megatron ramps up only in sample-based training)")
    if args.rampup_batch_size is not None:
        values = _int_list("rampup_batch_size", args.rampup_batch_size, fail)
        if len(values) != 3 or min(values) <= 0:
            fail(f"--rampup-batch-size expects three positive integers: start increment samples, got "
                 f"{' '.join(args.rampup_batch_size)!r}")
        if args.global_batch_size is None:
            fail("--rampup-batch-size needs --global-batch-size (the batch size it ramps up to)")
        start, increment, _ = values
        if start > args.global_batch_size or (args.global_batch_size - start) % increment:
            fail(f"--rampup-batch-size: --global-batch-size {args.global_batch_size} minus the start "
                 f"{start} must be a non-negative multiple of the increment {increment}")
    else:
        entries = args.step_batch_size_schedule.replace(",", " ").split()
        if not entries or any(":" not in e for e in entries):
            fail(f"--step-batch-size-schedule {args.step_batch_size_schedule!r}: expected "
                 "'THRESHOLD:BATCH THRESHOLD:BATCH ...'")
        final = batch_schedule_from_args(args, fail).final
        if args.global_batch_size is not None and not args.global_batch_size_from_schedule:
            fail("--step-batch-size-schedule and --global-batch-size contradict each other (the "
                 "schedule's last batch size is the global batch size)")
        args.global_batch_size, args.global_batch_size_from_schedule = final, True


def interleaved_group_size(args) -> int | None:
    """--microbatch-group-size-per-virtual-pipeline-stage where it acts, the interleaved
    schedule (None: its default, the pipeline size; and under every other schedule)."""
    if args.pipeline_schedule != "interleaved_1f1b":
        return None
    return args.microbatch_group_size_per_virtual_pipeline_stage


def finish_batch_args(args, fail) -> None:
    """After the batch and schedule checks: every batch size the run will use (ramp-up or step
    schedule, and --eval-global-batch-size) divides into micro-batches, each count runs under
    the pipeline schedule, and --train-samples counts iterations as Megatron counts them."""
    per_step = args.micro_batch_size * args.data_parallel_size
    schedule = batch_schedule_from_args(args, fail)
    sizes = (schedule.sizes(args.train_samples, args.train_iters) if schedule.varies and not args.skip_train
             else [])
    if args.eval_global_batch_size is not None:
        sizes.append(args.eval_global_batch_size)
    flag = "--rampup-batch-size" if args.rampup_batch_size else "--step-batch-size-schedule"
    for size in sizes:
        which = "--eval-global-batch-size" if size == args.eval_global_batch_size else flag
        if size % per_step:
            fail(f"{which}: batch size {size} is not divisible by --micro-batch-size "
                 f"{args.micro_batch_size} x data-parallel size {args.data_parallel_size} = {per_step}")
        validate_schedule(args.pipeline_schedule, args.pipeline_model_parallel_size, size // per_step,
                          args.virtual_pipeline_model_parallel_size, interleaved_group_size(args))
    if schedule.varies and not args.skip_train and args.train_samples is not None:
        args.total_train_iters = schedule.train_iters(args.train_samples)


def megatron_training_notes(args) -> list[str]:
    """One line for each flag given that megalite serves another way, or that has no effect here."""
    notes = []
    if args.ddp_average_in_collective:
        notes.append("--ddp-average-in-collective: megalite averages gradients in the collective "
                     "(ReduceOp.AVG) on NCCL already; gloo has no AVG, so there it pre-scales by 1/DP "
                     "and sums: the same average")
    if args.overlap_p2p_comm is not None or args.overlap_p2p_communication_warmup_flush:
        notes.append("--overlap-p2p-communication: megalite's pipeline executor always overlaps "
                     "transfers with compute (each compute waits only for the receive it reads, in "
                     "warm-up and flush too); the flag changes nothing")
    if args.test_mode:
        notes.append("--test-mode: before every iteration the --qk-layernorm weights of every layer are compared "
                     "across data- and tensor-parallel ranks (Megatron compares them in every attention forward)"
                     if args.qk_layernorm else "--test-mode: no effect without --qk-layernorm (Megatron's real-time "
                     "test compares only the query/key layernorm weights)")
    if args.disable_gloo_process_groups:
        notes.append("--disable-gloo-process-groups: megalite creates no Gloo groups beside its backend's (its "
                     "optimizer checkpoints need none); the one exception is the group --async-save's background "
                     "writes use on an NCCL run" + (", which this run has" if args.async_save else ""))
    unused = [f"--{n.replace('_', '-')} {getattr(args, n)}" for n in ("recompute_method", "recompute_num_layers")
              if getattr(args, n) is not None]
    if unused and args.recompute_granularity is None and not args.recompute_activations:
        notes.append(f"{' and '.join(unused)}: no effect without --recompute-granularity (nothing is recomputed; "
                     "Megatron ignores them there too)")
    if args.error_injection_rate and args.rerun_mode != "validate_results":
        notes.append(f"--error-injection-rate {args.error_injection_rate}: no effect with --rerun-mode "
                     f"{args.rerun_mode} (Megatron injects only where results are validated, validate_results)")
    if args.fp16 and args.loss_scale is None and args.check_for_nan_in_loss_and_grad:
        notes.append("--fp16 with dynamic loss scaling: a step with NaN or Inf gradients lowers the scale and is "
                     "skipped, not stopped (Megatron turns --check-for-nan-in-loss-and-grad off there too)")
    if args.use_pytorch_profiler:
        notes.append("--use-pytorch-profiler: megalite's --profile always uses torch.profiler")
    if args.enable_cuda_graph:
        notes.append("--enable-cuda-graph is deprecated: running with --cuda-graph-impl local, as Megatron does")
    if args.cuda_graph_scope and cuda_graph_impl_of(args) == "none":
        notes.append("--cuda-graph-scope: no effect without --cuda-graph-impl local (Megatron ignores it too)")
    group = args.microbatch_group_size_per_virtual_pipeline_stage
    if group is not None and interleaved_group_size(args) is None:
        notes.append(f"--microbatch-group-size-per-virtual-pipeline-stage {group}: no effect without virtual "
                     "pipeline stages (it groups the interleaved schedule's micro-batches; Megatron ignores it "
                     "there too)")
    if args.empty_unused_memory_level and on_cpu(args):
        notes.append(f"--empty-unused-memory-level {args.empty_unused_memory_level}: this run is on "
                     "CPU, where there is no CUDA cache to empty")
    return notes


def apply_pipeline_split_accounting(args, fail) -> None:
    """--account-for-embedding/loss-in-pipeline-split as Megatron splits layers: the embedding
    and the loss each count as one layer, (L + 1 [+ 1]) / p per stage, so the first (last) stage
    builds one transformer layer fewer. Without virtual stages megalite expresses that split with
    --decoder-first/last-pipeline-num-layers; with them the first (last) virtual stage builds one
    layer fewer, which stage_layout builds from split_accounting(args)."""
    embedding, loss = args.account_for_embedding_in_pipeline_split, args.account_for_loss_in_pipeline_split
    p = args.pipeline_model_parallel_size
    if not (embedding or loss) or p == 1:
        return
    flag = "--account-for-embedding-in-pipeline-split" if embedding else "--account-for-loss-in-pipeline-split"
    if args.num_layers_per_virtual_pipeline_stage:
        fail(f"{flag} and --num-layers-per-virtual-pipeline-stage contradict each other (give "
             "--num-virtual-stages-per-pipeline-rank: the accounted layers set the layers per virtual stage)")
    if (args.num_virtual_stages_per_pipeline_rank or 1) > 1:
        return  # the virtual stages' split: parallel.pipeline.stage_layout, given both flags (split_accounting)
    counted = args.num_layers + embedding + loss
    if counted % p:
        fail(f"{flag}: --num-layers {args.num_layers} plus the accounted embedding/loss ({counted}) is "
             f"not divisible by --pipeline-model-parallel-size {p}")
    per_stage = counted // p
    for name, on in (("decoder_first_pipeline_num_layers", embedding),
                     ("decoder_last_pipeline_num_layers", loss)):
        if not on:
            continue
        if getattr(args, name) not in (None, per_stage - 1):  # a second validation finds it filled
            fail(f"{flag} and --{name.replace('_', '-')} contradict each other (give one)")
        if per_stage - 1 < 1:
            fail(f"{flag}: the first or last stage would hold no transformer layer")
        setattr(args, name, per_stage - 1)


def split_accounting(args) -> dict:
    """The --account-for-*-in-pipeline-split flags as stage_layout takes them where megalite does
    not express the split through --decoder-first/last-pipeline-num-layers (virtual stages)."""
    virtual = (args.num_virtual_stages_per_pipeline_rank or 1) > 1 and args.pipeline_model_parallel_size > 1
    return {"embedding_stage": virtual and args.account_for_embedding_in_pipeline_split,
            "loss_stage": virtual and args.account_for_loss_in_pipeline_split, "layout_counts": layout_counts(args)}
