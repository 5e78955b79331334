"""The boundary where parsed options become typed configs: `run_config(args, world_size)`
validates `args` and returns a RunConfig whose parts are what each part of megalite receives.

    model       GPTConfig (megalite.model.config)      the model builder, the FLOP count
    parallel    ParallelConfig                         process groups, wrappers, the pipeline
    optimizer   OptimizerConfig                        the optimizer and its LR schedule
    data        DataConfig                             datasets, loaders, the batch schedule
    checkpoint  CheckpointConfig                       save, load and resume policies
    logging     LoggingConfig                          console, metrics file, TensorBoard, wandb
    training    TrainingConfig                         the loop: iterations, evaluation, exits

Fields keep the option names (their help is in `--help` and megalite/config/arguments_*.py);
a field that is not an option says so and how it is derived. Deep code never sees `args`.
"""

import os
from dataclasses import dataclass, fields

import torch

from megalite.config.arguments import layout_from_args, model_config_from_args, validate_args
from megalite.config.fp8 import fp8_notes, fp8_recipe_from_args
from megalite.config.dist_opt import data_parallel_plan, dist_opt_notes, tp_comm_overlap_settings
from megalite.config.megatron.checkpoint import checkpoint_flag_notes
from megalite.config.megatron.data import megatron_data_notes
from megalite.config.megatron.fim import fim_notes, fim_transform_from_args
from megalite.config.megatron.logs import megatron_logging_notes
from megalite.config.megatron.engine import engine_notes
from megalite.config.model import recompute_notes
from megalite.config.megatron.model import start_up_notes, tokenizer_from_args
from megalite.config.megatron.training import (cuda_graph_impl_of, cuda_graph_scope_of,
                                                         interleaved_group_size, megatron_training_notes,
                                                         split_accounting)
from megalite.config.gdn import gdn_notes
from megalite.config.mla import mla_notes
from megalite.config.moe import dense_expert_notes
from megalite.config.mup import mup_notes, mup_width_mult
from megalite.config.muon import muon_options
from megalite.config.optional_packages import check_optional_packages
from megalite.config.schedules import BatchSchedule, batch_schedule_from_args, schedule_lengths_from_args
from megalite.model.config import GPTConfig
from megalite.parallel.state import ParallelLayout


def _options(cls, args, **derived):
    """An instance of `cls` whose fields are taken from `args` by name, or from `derived`."""
    return cls(**{f.name: derived[f.name] if f.name in derived else getattr(args, f.name) for f in fields(cls)})


def compute_dtype(args) -> torch.dtype:
    """The dtype activations and 16-bit weights compute in (--bf16, --fp16, else fp32)."""
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


@dataclass(frozen=True)
class ParallelConfig:
    """The layout and how ranks talk: process groups, data-parallel wrapping, the pipeline."""

    layout: ParallelLayout
    backend: str  # derived: --distributed-backend, else nccl with CUDA and gloo without
    distributed_timeout_minutes: float
    pipeline_schedule: str
    microbatch_group_size: int | None  # derived: the interleaved schedule's group size, else None
    decoder_first_pipeline_num_layers: int | None
    decoder_last_pipeline_num_layers: int | None
    pipeline_embedding_stage: bool  # derived: --account-for-embedding-in-pipeline-split with virtual stages
    pipeline_loss_stage: bool  # derived: --account-for-loss-in-pipeline-split with virtual stages
    pipeline_layout_counts: tuple | None  # derived: decoder layers per virtual stage of --pipeline-model-parallel-layout
    num_experts: int | None
    expert_model_parallel_size: int
    expert_tensor_parallel_size: int | None
    use_torch_fsdp2: bool  # derived: --use-torch-fsdp2, or --use-megatron-fsdp's optim_grads(_params)
    use_distributed_optimizer: bool  # derived: --use-distributed-optimizer, or --use-megatron-fsdp's optim
    fsdp2_reshard_after_forward: bool  # derived: False for --use-megatron-fsdp's optim_grads (ZeRO-2)
    fsdp2_reduce_dtype: torch.dtype  # derived: --megatron-fsdp-grad-comm-dtype under FSDP2, else fp32
    ddp_bucket_size: int | None
    overlap_grad_reduce: bool
    gradient_accumulation_fusion: bool  # derived: on unless --no-gradient-accumulation-fusion or FSDP2
    grad_reduce_dtype: torch.dtype  # derived: fp32, fp16 with --fp16 unless accumulated in fp32, or bf16
    compute_dtype: torch.dtype  # derived: --bf16 / --fp16 / fp32
    num_micro_batches: int | None  # derived: B / (b x DP)
    init_on_shard: bool
    torch_compile: bool
    overlap_param_gather_with_optimizer_step: bool
    defer_embedding_wgrad_compute: bool
    wgrad_deferral_limit: int
    tp_comm_overlap: dict | None  # derived: each GEMM's OverlapSetting under --tp-comm-overlap (-cfg), else None

    @classmethod
    def from_args(cls, args, world_size: int) -> "ParallelConfig":
        plan = data_parallel_plan(args)
        grad_dtype = torch.float16 if args.fp16 and not args.accumulate_allreduce_grads_in_fp32 else torch.float32
        if args.grad_reduce_in_bf16:
            grad_dtype = torch.bfloat16
        backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
        accounting = split_accounting(args)
        return _options(cls, args, layout=layout_from_args(args, world_size), backend=backend,
                        microbatch_group_size=interleaved_group_size(args), grad_reduce_dtype=plan.grad_dtype or grad_dtype,
                        pipeline_embedding_stage=accounting["embedding_stage"], pipeline_loss_stage=accounting["loss_stage"],
                        pipeline_layout_counts=None if accounting["layout_counts"] is None else tuple(accounting["layout_counts"]),
                        compute_dtype=compute_dtype(args), use_torch_fsdp2=plan.fsdp2,
                        use_distributed_optimizer=plan.distributed_optimizer,
                        fsdp2_reshard_after_forward=plan.fsdp2_reshard_after_forward,
                        fsdp2_reduce_dtype=plan.fsdp2_reduce_dtype, tp_comm_overlap=tp_comm_overlap_settings(args),
                        gradient_accumulation_fusion=args.gradient_accumulation_fusion is not False and not plan.fsdp2)


@dataclass(frozen=True)
class LRScheduleConfig:
    """The learning-rate schedule, its lengths in samples (see config/schedules.py)."""

    max_lr: float
    min_lr: float
    init_lr: float
    decay_style: str
    wsd_decay_style: str
    warmup_steps: float
    decay_steps: float
    wsd_decay_steps: float | None

    @classmethod
    def from_args(cls, args) -> "LRScheduleConfig":
        if args.lr is None:
            raise ValueError("an lr schedule needs --lr")
        return cls(max_lr=args.lr, min_lr=args.min_lr, init_lr=args.lr_warmup_init, decay_style=args.lr_decay_style,
                   wsd_decay_style=args.lr_wsd_decay_style, **schedule_lengths_from_args(args))


@dataclass(frozen=True)
class OptimizerConfig:
    """The optimizer, mixed precision and loss scaling, and the LR schedule (None with
    --skip-train, which builds no optimizer)."""

    optimizer: str
    lr: float | None
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    sgd_momentum: float
    clip_grad: float
    fp16: bool
    bf16_main_params: bool  # derived: --bf16 without FSDP2 (which keeps fp32 shards itself)
    loss_scale: float | None
    initial_loss_scale: float
    min_loss_scale: float
    loss_scale_window: float
    hysteresis: int
    use_distributed_optimizer: bool  # derived: as ParallelConfig's
    overlap_param_gather: bool  # derived: --overlap-param-gather where there is a parameter all-gather to overlap
    overlap_param_gather_with_optimizer_step: bool
    optimizer_cpu_offload: bool
    log_num_zeros_in_grad: bool
    apply_wd_to_qk_layernorm: bool
    decoupled_lr: float | None
    decoupled_min_lr: float | None
    lr_schedule: LRScheduleConfig | None
    mup_width_mult: float  # derived: hidden / --mup-base-hidden-size under --use-mup, else 1 (optimizer.mup)
    muon: dict | None  # derived: build_muon_optimizer's Muon keywords under --optimizer muon (config.muon)

    @classmethod
    def from_args(cls, args) -> "OptimizerConfig":
        schedule = None if args.skip_train else LRScheduleConfig.from_args(args)
        plan = data_parallel_plan(args)
        return _options(cls, args, bf16_main_params=args.bf16 and not plan.fsdp2, lr_schedule=schedule,
                        mup_width_mult=mup_width_mult(args), muon=muon_options(args),
                        use_distributed_optimizer=plan.distributed_optimizer,
                        overlap_param_gather=args.overlap_param_gather and plan.distributed_optimizer)


@dataclass(frozen=True)
class DataConfig:
    """Datasets, their loaders and the batch sizes each iteration and evaluation takes."""

    data_path: list[str] | None
    split: str | None
    train_data_path: list[str] | None
    valid_data_path: list[str] | None
    test_data_path: list[str] | None
    data_cache_path: str | None
    mock_data: bool
    mmap_bin_files: bool  # derived: not --no-mmap-bin-files
    eod_mask_loss: bool
    reset_position_ids: bool
    reset_attention_mask: bool
    num_workers: int
    seq_length: int
    seed: int
    micro_batch_size: int
    global_batch_size: int
    eval_global_batch_size: int | None
    eval_interval: int
    eval_iters: int
    train_samples: int | None
    total_train_iters: int
    batch_schedule: BatchSchedule  # derived: --global-batch-size, its ramp-up or step schedule
    tokenizer_type: str | None
    tokenizer_model: str | None
    vocab_file: str | None
    merge_file: str | None
    fim: object | None = None  # derived: --fim-data's sample transform (megalite.data.fim.FimTransform)

    @classmethod
    def from_args(cls, args, fim=None) -> "DataConfig":
        return _options(cls, args, mmap_bin_files=not args.no_mmap_bin_files,
                        batch_schedule=batch_schedule_from_args(args), fim=fim)

    @property
    def eval_batch_size(self) -> int:
        return self.eval_global_batch_size or self.global_batch_size

    def tokenizer_record(self) -> dict:
        """The tokenizer files, as a checkpoint's common.json records them."""
        return {"type": self.tokenizer_type, "model": self.tokenizer_model, "vocab_file": self.vocab_file,
                "merge_file": self.merge_file}


@dataclass(frozen=True)
class CheckpointConfig:
    """Where checkpoints go and come from, and Megatron's policies for both."""

    save: str | None
    load: str | None
    save_interval: int | None
    ckpt_format: str  # derived: --ckpt-format, with Megatron-FSDP's fsdp_dtensor written as dcp
    auto_detect_ckpt_format: bool
    async_save: bool
    no_save_optim: bool
    no_save_rng: bool
    no_load_optim: bool
    no_load_rng: bool
    finetune: bool
    ckpt_fallback_to_previous: bool
    ckpt_step: int | None
    pretrained_checkpoint: str | None
    dist_ckpt_strictness: str
    use_checkpoint_opt_param_scheduler: bool
    override_opt_param_scheduler: bool
    non_persistent_save_interval: int | None
    non_persistent_ckpt_type: str | None
    non_persistent_global_ckpt_dir: str | None
    non_persistent_local_ckpt_dir: str | None
    save_retain_interval: int | None
    ckpt_fully_parallel_save: bool
    ckpt_assume_constant_structure: bool
    verify_integrity: bool
    skip_train: bool
    optimizer: str  # the run's --optimizer and --weight-decay, which a Megatron checkpoint's
    weight_decay: float  # optimizer state and schedule must match to be resumed

    @classmethod
    def from_args(cls, args) -> "CheckpointConfig":
        # Megatron-FSDP's fsdp_dtensor is written as megalite's DCP checkpoints (dist_opt.py)
        return _options(cls, args, ckpt_format="dcp" if args.ckpt_format == "fsdp_dtensor" else args.ckpt_format)


@dataclass(frozen=True)
class LoggingConfig:
    """What is logged where: the console line and timers, the metrics file, TensorBoard, wandb,
    progress.txt and profiles."""

    log_interval: int
    timing_log_level: int
    timing_log_option: str
    log_params_norm: bool
    log_straggler: bool
    metrics_file: str | None
    tensorboard_dir: str | None
    tensorboard_log_interval: int
    tensorboard_queue_size: int
    log_learning_rate_to_tensorboard: bool
    log_batch_size_to_tensorboard: bool
    log_loss_scale_to_tensorboard: bool
    log_world_size_to_tensorboard: bool
    log_memory_to_tensorboard: bool
    log_timers_to_tensorboard: bool
    log_validation_ppl_to_tensorboard: bool
    wandb_project: str | None
    wandb_exp_name: str | None
    wandb_entity: str | None
    wandb_save_dir: str | None  # resolved: --wandb-save-dir, else <save>/wandb, else None
    progress_dir: str | None  # derived: --save with --log-progress (progress.txt goes there), else None
    profile: bool
    profile_ranks: list[str] | None
    profile_step_start: int
    profile_step_end: int
    profile_dir: str | None  # derived: --tensorboard-dir, else <save>/profile

    @classmethod
    def from_args(cls, args) -> "LoggingConfig":
        save = args.save
        return _options(cls, args, wandb_save_dir=args.wandb_save_dir or (os.path.join(save, "wandb") if save else None),
                        progress_dir=save if args.log_progress and save else None,
                        profile_dir=args.tensorboard_dir or (os.path.join(save, "profile") if save else None))


@dataclass(frozen=True)
class TrainingConfig:
    """The loop: how long, evaluation, when to stop, and the step's own switches."""

    total_train_iters: int
    skip_train: bool
    seq_length: int
    micro_batch_size: int
    global_batch_size: int
    eval_interval: int
    eval_iters: int
    exit_interval: int | None
    exit_duration_in_mins: float | None
    exit_reason_file: str | None
    rerun_mode: str
    check_for_nan_in_loss_and_grad: bool  # resolved: off under --fp16's dynamic loss scaling, as Megatron
    error_injection_rate: int
    error_injection_type: str
    test_mode: bool
    empty_unused_memory_level: int
    manual_gc: bool
    manual_gc_interval: int
    manual_gc_eval: bool
    check_weight_hash_across_dp_replicas_interval: int | None
    calculate_per_token_loss: bool
    deterministic_mode: bool
    seed: int
    split: str | None
    cuda_graph_impl: str  # resolved: --cuda-graph-impl, or what --enable/--external-cuda-graph stand for
    cuda_graph_scope: tuple[str, ...]  # normalised as Megatron does: () is whole layers (none given, or full)
    cuda_graph_warmup_steps: int

    @classmethod
    def from_args(cls, args) -> "TrainingConfig":
        return _options(cls, args, cuda_graph_impl=cuda_graph_impl_of(args),
                        cuda_graph_scope=cuda_graph_scope_of(args),
                        check_for_nan_in_loss_and_grad=bool(args.check_for_nan_in_loss_and_grad)
                        and not (args.fp16 and args.loss_scale is None))


@dataclass(frozen=True)
class RunConfig:
    model: GPTConfig
    parallel: ParallelConfig
    optimizer: OptimizerConfig
    data: DataConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    training: TrainingConfig
    tokenizer: object  # the run's tokenizer, built from its flags; its vocabulary sizes the model
    options: dict  # every option's value: stored with each checkpoint (--use-checkpoint-args) and given to wandb
    notes: tuple[str, ...]  # one start-up line per flag megalite serves another way or that has no effect
    fp8: object = None  # the Fp8Recipe of an --fp8-format run (parallel/tensor/fp8_scaling.py), else None


def startup_notes(args, device_type: str = "cpu") -> list[str]:
    """One line for each Megatron flag megalite serves another way or that has no effect here
    (`device_type`: where the model runs, which decides how --attention-backend is served)."""
    notes = []
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        notes.append("--sequence-parallel: no effect at --tensor-model-parallel-size 1 (nothing to split "
                     "the sequence over); running without it, as Megatron does")
    return (notes + start_up_notes(args, device_type) + megatron_training_notes(args) + megatron_data_notes(args)
            + megatron_logging_notes(args) + checkpoint_flag_notes(args) + dense_expert_notes(args) + fim_notes(args)
            + mup_notes(args) + dist_opt_notes(args)
            + mla_notes(args) + gdn_notes(args) + fp8_notes(args) + engine_notes(args) + recompute_notes(args))


def run_config(args, world_size: int) -> RunConfig:
    """Validate `args` for `world_size` processes (before any process group) and type them."""
    validate_args(args, world_size)
    check_optional_packages(args)  # a run's writers and tokenizer: not needed by a dry run or the planner
    parallel = ParallelConfig.from_args(args, world_size)
    tokenizer = tokenizer_from_args(args)
    model = model_config_from_args(args, tokenizer.vocab_size)
    if parallel.use_torch_fsdp2:
        model = model.replace(params_dtype="float32")  # FSDP2 keeps fp32 shards, computes in bf16/fp16
    device_type = "cuda" if parallel.backend == "nccl" else "cpu"
    fim, fim_lines = fim_transform_from_args(args, tokenizer)
    return RunConfig(model=model, parallel=parallel, optimizer=OptimizerConfig.from_args(args),
                     data=DataConfig.from_args(args, fim), checkpoint=CheckpointConfig.from_args(args),
                     logging=LoggingConfig.from_args(args), training=TrainingConfig.from_args(args),
                     tokenizer=tokenizer, options=args.to_dict(),
                     notes=tuple(startup_notes(args, device_type) + fim_lines), fp8=fp8_recipe_from_args(args))
