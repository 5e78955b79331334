"""Checks on parsed options: every impossible or contradictory combination is refused with a
one-line ValueError naming the flags and numbers. Nothing the user chose is rewritten; only
unset values are filled (documented on each field) and derived values are added.
"""

from dataclasses import fields

from megalite.parallel.pipeline.schedules import default_schedule, validate_schedule
from megalite.parallel.pipeline.stage_layout import layers_per_virtual_stage, virtual_stages_per_rank
from megalite.parallel.state import ParallelLayout
from megalite.config.context import check_context_args
from megalite.config.dist_opt import check_dist_opt_args
from megalite.config.dry_run import check_dry_run_args
from megalite.config.field import flag_of
from megalite.config.flash_attn import check_flash_attn_args
from megalite.config.fp8 import check_fp8_args
from megalite.config.megatron.checkpoint import check_megatron_checkpoint_args
from megalite.config.megatron.data import apply_megatron_data_args
from megalite.config.megatron.fim import check_fim_args
from megalite.config.megatron.engine import check_engine_args
from megalite.config.megatron.logs import check_megatron_logging_args
from megalite.config.megatron.model import check_megatron_model_args
from megalite.config.megatron.training import (apply_pipeline_split_accounting,
                                                           check_megatron_training_args, finish_batch_args,
                                                           interleaved_group_size, split_accounting)
from megalite.config.gdn import check_gdn_args
from megalite.config.mla import check_mla_args
from megalite.config.model import check_recompute_modules
from megalite.config.moe import check_expert_width, check_moe_args
from megalite.config.mup import check_mup_args
from megalite.config.pipeline_layout import apply_pipeline_layout
from megalite.config.muon import check_muon_args
from megalite.config.schedules import schedule_lengths_from_args

_POSITIVE = (
    "tensor_model_parallel_size", "pipeline_model_parallel_size", "num_layers", "hidden_size",
    "ffn_hidden_size", "num_attention_heads", "num_query_groups", "kv_channels", "seq_length",
    "max_position_embeddings", "num_layers_per_virtual_pipeline_stage",
    "num_virtual_stages_per_pipeline_rank", "decoder_first_pipeline_num_layers",
    "decoder_last_pipeline_num_layers", "ddp_bucket_size", "distributed_timeout_minutes",
    "make_vocab_size_divisible_by", "recompute_num_layers", "micro_batch_size",
    "global_batch_size", "train_iters", "train_samples", "lr_decay_iters", "lr_decay_samples",
    "lr_wsd_decay_iters", "lr_wsd_decay_samples", "log_interval", "eval_interval",
    "save_interval", "exit_interval", "vocab_size", "loss_scale", "initial_loss_scale",
    "min_loss_scale", "loss_scale_window", "hysteresis", "norm_epsilon", "adam_eps",
    "init_method_std", "exit_duration_in_mins",
)
_NON_NEGATIVE = (
    "lr", "min_lr", "lr_warmup_iters", "lr_warmup_samples", "lr_warmup_init", "weight_decay",
    "clip_grad", "eval_iters", "num_workers", "sgd_momentum", "seed",
)
_FRACTIONS = (  # 0 <= x < 1
    "attention_dropout", "hidden_dropout", "label_smoothing", "adam_beta1", "adam_beta2",
    "lr_warmup_fraction",
)
_TOKENIZER_NEEDS = {
    "GPT2BPETokenizer": ("vocab_file", "merge_file"),
    "SentencePieceTokenizer": ("tokenizer_model",),
    "GPTSentencePieceTokenizer": ("tokenizer_model",),
    "Llama2Tokenizer": ("tokenizer_model",),
    "HuggingFaceTokenizer": ("tokenizer_model",),
    "TikTokenizer": ("tokenizer_model",),
    "NullTokenizer": ("vocab_size",),
}


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _fail(message: str):
    raise ValueError(message)


def default_ffn_hidden_size(args) -> int:
    """Megatron's MLP width when --ffn-hidden-size is absent: 4h, or int(8h/3 / 64)*64 for SwiGLU."""
    if args.ffn_hidden_size is not None:
        return args.ffn_hidden_size
    if args.swiglu:
        return int((4 * args.hidden_size * 2 / 3) / 64) * 64
    return 4 * args.hidden_size


def virtual_stages(args) -> int:
    """Model chunks per pipeline rank, from either of Megatron's two virtual-pipeline flags."""
    uneven = (args.decoder_first_pipeline_num_layers is not None
              or args.decoder_last_pipeline_num_layers is not None)
    return virtual_stages_per_rank(args.num_layers, args.pipeline_model_parallel_size,
                                   args.num_layers_per_virtual_pipeline_stage,
                                   args.num_virtual_stages_per_pipeline_rank, uneven=uneven)


def layout_from_args(args, world_size: int) -> ParallelLayout:
    """The parallel layout of these options at `world_size`, checked against the model shape.

    Raises ValueError naming the flags before any process group exists."""
    _require(args, ("num_layers", "hidden_size", "num_attention_heads"))
    layout = ParallelLayout(world_size, tensor=args.tensor_model_parallel_size,
                            pipeline=args.pipeline_model_parallel_size,
                            virtual_pipeline=virtual_stages(args), context=args.context_parallel_size,
                            tp_pp_dp_mapping=args.use_tp_pp_dp_mapping,
                            optimizer_instances=args.num_distributed_optimizer_instances)
    layout.check_model(args.num_layers, args.hidden_size, args.num_attention_heads,
                       args.num_query_groups if args.group_query_attention else None,
                       args.kv_channels)
    return layout


def _require(args, names):
    for name in names:
        if getattr(args, name) is None:
            _fail(f"{_flag(name)} is required")


def _check_ranges(args):
    for name in _POSITIVE:
        value = getattr(args, name)
        if value is not None and not value > 0:
            _fail(f"{_flag(name)} must be positive, got {value}")
    for name in _NON_NEGATIVE:
        value = getattr(args, name)
        if value is not None and value < 0:
            _fail(f"{_flag(name)} must not be negative, got {value}")
    for name in _FRACTIONS:
        value = getattr(args, name)
        if value is not None and not 0.0 <= value < 1.0:
            _fail(f"{_flag(name)} must be in [0, 1), got {value}")
    if not 0.0 < args.rotary_percent <= 1.0:
        _fail(f"--rotary-percent must be in (0, 1], got {args.rotary_percent}")


def _check_unsupported(args):
    for f in fields(args):
        if getattr(args, f.name) in f.metadata.get("unsupported", ()):
            supported = [c for c in f.metadata["choices"] if c not in f.metadata["unsupported"]]
            _fail(f"{flag_of(f)} {getattr(args, f.name)} is not implemented in megalite "
                  f"(supported: {', '.join(map(str, supported))})")


def _check_model(args):
    if args.group_query_attention and args.num_query_groups is None:
        _fail("--group-query-attention needs --num-query-groups")
    if (args.num_query_groups is not None and not args.group_query_attention
            and args.num_query_groups != args.num_attention_heads):
        _fail(f"--num-query-groups {args.num_query_groups} needs --group-query-attention")
    if args.swiglu and args.openai_gelu:
        _fail("--swiglu and --openai-gelu contradict each other (SwiGLU has no GeLU)")
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    if args.max_position_embeddings < args.seq_length:
        _fail(f"--max-position-embeddings {args.max_position_embeddings} is smaller than "
              f"--seq-length {args.seq_length}")
    if args.ffn_hidden_size is None:
        args.ffn_hidden_size = default_ffn_hidden_size(args)
    if args.bf16 and args.fp16:
        _fail("--bf16 and --fp16 contradict each other (give one)")
    if args.loss_scale is not None and not args.fp16:
        _fail(f"--loss-scale {args.loss_scale} applies only to --fp16")


def _check_recompute(args, layers_per_chunk: int):
    if args.recompute_activations:
        if args.recompute_granularity == "full":
            _fail("--recompute-activations (selective) contradicts --recompute-granularity full")
        args.recompute_granularity = "selective"
    if args.recompute_granularity is None:
        return  # as Megatron, which ignores them without recomputation (a start-up line says so)
    for name in ("recompute_method", "recompute_num_layers"):
        if getattr(args, name) is not None and args.recompute_granularity != "full":
            _fail(f"{_flag(name)} {getattr(args, name)} needs --recompute-granularity full "
                  f"(got {args.recompute_granularity})")
    if args.recompute_num_layers is not None and args.recompute_num_layers > layers_per_chunk:
        _fail(f"--recompute-num-layers {args.recompute_num_layers} exceeds the {layers_per_chunk} "
              "layers of one pipeline stage (model chunk)")


def _check_pipeline(args, layout: ParallelLayout) -> int:
    """Checks the layer split over (virtual) stages, the one the model is built with; returns
    the most layers one model chunk holds."""
    return max(layers_per_virtual_stage(args.num_layers, layout.pipeline, layout.virtual_pipeline,
                                        args.decoder_first_pipeline_num_layers,
                                        args.decoder_last_pipeline_num_layers, **split_accounting(args)))


def _check_parallel(args, layout: ParallelLayout):
    tp = layout.tensor
    if args.sequence_parallel and args.seq_length % tp:
        _fail(f"--seq-length {args.seq_length} is not divisible by --tensor-model-parallel-size "
              f"{tp} (needed by --sequence-parallel)")
    if args.ffn_hidden_size % tp:
        _fail(f"--ffn-hidden-size {args.ffn_hidden_size} is not divisible by "
              f"--tensor-model-parallel-size {tp}")
    if args.overlap_param_gather and not (args.use_distributed_optimizer or args.use_megatron_fsdp):
        _fail("--overlap-param-gather needs --use-distributed-optimizer (or --use-megatron-fsdp)")
    if args.overlap_param_gather and not args.overlap_grad_reduce:
        _fail("--overlap-param-gather needs --overlap-grad-reduce")
    if args.use_torch_fsdp2 and args.use_distributed_optimizer:
        _fail("--use-torch-fsdp2 and --use-distributed-optimizer contradict each other (give one)")
    check_dist_opt_args(args, _fail, layout)


def _check_batch(args, layout: ParallelLayout):
    dp, mbs = layout.data, args.micro_batch_size
    if args.global_batch_size is None:
        args.global_batch_size = mbs * dp
    if args.global_batch_size % (mbs * dp):
        _fail(f"--global-batch-size {args.global_batch_size} is not divisible by "
              f"--micro-batch-size {mbs} x data-parallel size {dp} = {mbs * dp} (world size "
              f"{layout.world_size} / (--tensor-model-parallel-size {layout.tensor} x "
              + (f"--context-parallel-size {layout.context} x " if layout.context > 1 else "")
              + f"--pipeline-model-parallel-size {layout.pipeline}))")
    args.world_size = layout.world_size
    args.data_parallel_size = dp
    args.virtual_pipeline_model_parallel_size = layout.virtual_pipeline
    args.num_micro_batches = args.global_batch_size // (mbs * dp)
    if args.pipeline_schedule is None:
        args.pipeline_schedule = default_schedule(layout.pipeline, layout.virtual_pipeline)
    validate_schedule(args.pipeline_schedule, layout.pipeline, args.num_micro_batches,
                      layout.virtual_pipeline, interleaved_group_size(args))


def _check_schedule(args):
    if args.train_iters is not None and args.train_samples is not None:
        _fail("--train-iters and --train-samples contradict each other (give one)")
    if args.skip_train:
        args.total_train_iters = 0
        return
    if args.train_iters is None and args.train_samples is None:
        _fail("one of --train-iters or --train-samples is required (or --skip-train)")
    _require(args, ("lr",))
    by_samples = args.train_samples is not None
    wrong = (("lr_decay_iters", "lr_warmup_iters", "lr_wsd_decay_iters") if by_samples else
             ("lr_decay_samples", "lr_warmup_samples", "lr_wsd_decay_samples"))
    mode = "--train-samples" if by_samples else "--train-iters"
    for name in wrong:
        if getattr(args, name):
            _fail(f"{_flag(name)} {getattr(args, name)} contradicts {mode} (count the schedule in "
                  f"{'samples' if by_samples else 'iterations'})")
    warmup_flag = "--lr-warmup-samples" if by_samples else "--lr-warmup-iters"
    if args.lr_warmup_fraction is not None and (args.lr_warmup_iters or args.lr_warmup_samples):
        _fail(f"{warmup_flag} and --lr-warmup-fraction contradict each other (give one)")
    if args.min_lr > args.lr:
        _fail(f"--min-lr {args.min_lr} is larger than --lr {args.lr}")
    if args.lr_warmup_init > args.lr:
        _fail(f"--lr-warmup-init {args.lr_warmup_init} is larger than --lr {args.lr}")
    wsd_flag = "--lr-wsd-decay-samples" if by_samples else "--lr-wsd-decay-iters"
    wsd_given = args.lr_wsd_decay_samples if by_samples else args.lr_wsd_decay_iters
    if args.lr_decay_style == "WSD" and wsd_given is None:
        _fail(f"--lr-decay-style WSD needs {wsd_flag}")
    if args.lr_decay_style != "WSD" and wsd_given is not None:
        _fail(f"{wsd_flag} applies only to --lr-decay-style WSD (got {args.lr_decay_style})")
    lengths = schedule_lengths_from_args(args)
    unit = "samples" if by_samples else (
        "samples (iterations x --global-batch-size)" if args.step_batch_size_schedule is None else
        "samples (iterations x --micro-batch-size x DP, as Megatron counts them under --step-batch-size-schedule)")
    if lengths["warmup_steps"] >= lengths["decay_steps"]:
        _fail(f"the lr warmup ({lengths['warmup_steps']:g} {unit}) must be shorter than the decay "
              f"({lengths['decay_steps']} {unit})")
    if lengths["wsd_decay_steps"] is not None and lengths["wsd_decay_steps"] > lengths["decay_steps"]:
        _fail(f"{wsd_flag} {wsd_given} is longer than the whole decay "
              f"({'--lr-decay-samples' if by_samples else '--lr-decay-iters'})")
    args.total_train_iters = (args.train_iters if not by_samples
                              else args.train_samples // args.global_batch_size)


def _check_weighted_paths(name: str, paths: list[str] | None):
    if paths is None or len(paths) <= 1:
        return
    ok = len(paths) % 2 == 0
    for weight in paths[0::2] if ok else ():
        try:
            ok = ok and float(weight) >= 0
        except ValueError:
            ok = False
    if not ok:
        _fail(f"{_flag(name)} expects one prefix or weight/prefix pairs 'w1 p1 w2 p2 ...', got "
              f"{' '.join(paths)!r}")


def _check_data(args):
    per_split = [n for n in ("train_data_path", "valid_data_path", "test_data_path")
                 if getattr(args, n) is not None]
    if args.data_path is not None and per_split:
        _fail(f"--data-path and {_flag(per_split[0])} contradict each other (give one)")
    if args.mock_data and (args.data_path is not None or per_split):
        other = "--data-path" if args.data_path is not None else _flag(per_split[0])
        _fail(f"--mock-data and {other} contradict each other (give one)")
    if args.data_path is None and not per_split and not args.mock_data:
        _fail("no data: give --data-path, --train-data-path (with --valid-data-path, "
              "--test-data-path) or --mock-data")
    if per_split and not args.skip_train and args.train_data_path is None:
        _fail(f"{_flag(per_split[0])} needs --train-data-path as well (or --skip-train)")
    if args.split is not None and args.data_path is None and not args.mock_data:
        _fail("--split applies only to --data-path and --mock-data")
    for name in ("data_path", "train_data_path", "valid_data_path", "test_data_path"):
        _check_weighted_paths(name, getattr(args, name))
    if args.data_path is not None or args.mock_data:
        if args.split is None:
            args.split = "969, 30, 1"
        parts = args.split.replace("/", ",").split(",")
        try:
            shares = [float(p) for p in parts]
        except ValueError:
            shares = []
        if not 1 <= len(shares) <= 3 or min(shares) < 0 or sum(shares) <= 0:
            _fail(f"--split {args.split!r} must be up to three non-negative numbers such as "
                  "'969, 30, 1'")
    _require(args, ("tokenizer_type",))
    for name in _TOKENIZER_NEEDS[args.tokenizer_type]:
        if getattr(args, name) is None:
            _fail(f"--tokenizer-type {args.tokenizer_type} needs {_flag(name)}")
    if args.vocab_size is not None and args.tokenizer_type not in ("NullTokenizer", "TikTokenizer"):
        _fail(f"--vocab-size applies only to --tokenizer-type NullTokenizer and TikTokenizer (got "
              f"{args.tokenizer_type}, whose vocabulary comes from its files)")


def _check_checkpointing(args):
    if args.async_save and args.save is None:
        _fail("--async-save needs --save")
    if args.finetune and args.load is None:
        _fail("--finetune needs --load")


def validate_args(args, world_size: int):
    """Refuse impossible or contradictory options for a run of `world_size` processes.

    Raises ValueError with one line naming the flags (and numbers) involved. Fills only unset
    values (--global-batch-size = b x DP, --max-position-embeddings = --seq-length,
    --ffn-hidden-size, --split, --pipeline-schedule as Megatron would run), normalises --recompute-activations to
    --recompute-granularity selective, and adds the derived world_size, data_parallel_size,
    virtual_pipeline_model_parallel_size, num_micro_batches and total_train_iters. Calling it
    again on its own result is allowed. Returns `args`."""
    _check_unsupported(args)
    check_flash_attn_args(args, _fail)
    check_context_args(args, _fail)
    check_moe_args(args, _fail, world_size)
    check_megatron_model_args(args, _fail)
    check_fp8_args(args, _fail)
    check_mup_args(args, _fail)
    check_muon_args(args, _fail)
    check_mla_args(args, _fail)
    check_gdn_args(args, _fail)
    check_dry_run_args(args, _fail)
    check_megatron_checkpoint_args(args, _fail)
    _require(args, ("num_layers", "hidden_size", "num_attention_heads", "seq_length",
                    "micro_batch_size"))
    _check_ranges(args)
    _check_model(args)
    check_expert_width(args, _fail)
    apply_pipeline_layout(args, _fail)
    apply_pipeline_split_accounting(args, _fail)
    layout = layout_from_args(args, world_size)
    layers_per_chunk = _check_pipeline(args, layout)
    _check_recompute(args, layers_per_chunk)
    check_recompute_modules(args, _fail)
    check_engine_args(args, _fail)
    _check_parallel(args, layout)
    check_megatron_training_args(args, world_size, _fail)
    _check_batch(args, layout)
    _check_schedule(args)
    finish_batch_args(args, _fail)
    apply_megatron_data_args(args, _fail)
    _check_data(args)
    check_fim_args(args, _fail)
    _check_checkpointing(args)
    check_megatron_logging_args(args, _fail)
    return args
