"""Megatron-LM's checkpoint flags (names, defaults and meanings from megatron/training/arguments.py
and checkpointing.py). Implemented ones change what is loaded or kept; the ones that tune how
Megatron's own writer works are accepted and the run says in one line how megalite serves them.
"""

from dataclasses import dataclass

from megalite.config.field import arg

STRICTNESS = ("assume_ok_unexpected", "log_unexpected", "log_all", "raise_unexpected", "raise_all",
              "return_unexpected", "return_all", "ignore_all")


# Megatron's load_args_from_checkpoint: (field, forced). Unforced fields are taken only where
# the run left them unset.
CHECKPOINT_MODEL_ARGS = (
    ("num_layers", False), ("hidden_size", False), ("ffn_hidden_size", False), ("seq_length", False),
    ("num_attention_heads", False), ("num_query_groups", True), ("group_query_attention", True),
    ("kv_channels", False), ("max_position_embeddings", False), ("position_embedding_type", True),
    ("rotary_base", True), ("rotary_percent", True), ("rotary_interleaved", True), ("add_qkv_bias", True),
    ("squared_relu", True), ("swiglu", True), ("untie_embeddings_and_output_weights", True),
    ("apply_layernorm_1p", True), ("normalization", True), ("apply_query_key_layer_scaling", True),
    ("attention_dropout", True), ("hidden_dropout", True), ("mtp_num_layers", True),
)


@dataclass
class MegatronCheckpointArgs:
    """Checkpoints (Megatron's formats and policies)."""

    auto_detect_ckpt_format: bool = arg(
        False, "Load a checkpoint in whichever format it is (torch or torch_dist) instead of "
        "refusing one that is not in --ckpt-format.")
    use_checkpoint_args: bool = arg(
        False, "Take the model's architecture arguments from the checkpoint under --load.")
    use_checkpoint_opt_param_scheduler: bool = arg(
        False, "Take the learning-rate schedule (lr, min lr, warmup, decay) from the checkpoint, "
        "ignoring this run's values.", flag="--use-checkpoint-opt_param-scheduler")
    override_opt_param_scheduler: bool = arg(
        False, "Keep this run's learning-rate schedule, taking only the step count from the "
        "checkpoint.", flag="--override-opt_param-scheduler")
    dist_ckpt_strictness: str = arg(
        "assume_ok_unexpected", "What to do with stored model tensors the model has no place for "
        "(unexpected) and, for *_all, with missing ones: assume_ok/return/ignore pass, log_* warn, "
        "raise_* stop.", choices=STRICTNESS)
    use_persistent_ckpt_worker: bool = arg(False, "Keep one background checkpoint writer for the whole run.")
    ckpt_fully_parallel_save: bool | None = arg(
        True, "Spread the writing of replicated tensors over the data-parallel ranks.",
        negative_flag="--no-ckpt-fully-parallel-save")
    ckpt_fully_parallel_load: bool = arg(False, "Spread the reading of replicated tensors over the ranks.")
    ckpt_assume_constant_structure: bool = arg(
        False, "The checkpoint's structure is the same at every save (lets Megatron cache its plan).")
    dist_ckpt_optim_fully_reshardable: bool = arg(
        False, "Save the optimizer state so that it loads at any parallel layout.")
    save_retain_interval: int | None = arg(
        None, "Keep only the checkpoints whose iteration is a multiple of this (and the latest); "
        "delete the others under --save.")
    non_persistent_save_interval: int | None = arg(
        None, "Also save a non-persistent checkpoint every this many iterations.")
    non_persistent_ckpt_type: str | None = arg(
        None, "Where non-persistent checkpoints go: local (--non-persistent-local-ckpt-dir), "
        "global (--non-persistent-global-ckpt-dir, default <save>/non_persistent).",
        choices=("global", "local", "in_memory"), unsupported=("in_memory",))
    non_persistent_global_ckpt_dir: str | None = arg(None, "Directory of global non-persistent checkpoints.")
    non_persistent_local_ckpt_dir: str | None = arg(None, "Directory of node-local non-persistent checkpoints.")
    non_persistent_local_ckpt_algo: str = arg(
        "fully_parallel", "How local checkpoints are written.", choices=("fully_parallel", "atomic"))
    verify_integrity: bool = arg(
        False, "Write a SHA-256 manifest (integrity.json, as Megatron's) with each saved checkpoint and "
        "check the loaded checkpoint's files against its manifest before reading them.")
    async_strategy: str | None = arg(
        None, "Which of Megatron's background checkpoint writers --async-save uses (Megatron's default nvrx).",
        choices=("nvrx", "mcore"))
    async_ckpt_use_cpu_shm: bool = arg(
        False, "With --async-save, stage the tensors in CPU shared memory before the background write.")
    ckpt_step: int | None = arg(None, "Load the checkpoint of this iteration instead of the latest.")
    pretrained_checkpoint: str | None = arg(
        None, "Checkpoint to fine-tune from when --load holds none: its weights only, from iteration 0.")


def check_megatron_checkpoint_args(args, fail) -> None:
    """Refuse contradictory or impossible values, with one line naming the flag."""
    if args.use_checkpoint_opt_param_scheduler and args.override_opt_param_scheduler:
        fail("--use-checkpoint-opt_param-scheduler and --override-opt_param-scheduler contradict each other")
    if args.dist_ckpt_strictness == "ignore_all":
        fail("--dist-ckpt-strictness ignore_all: megalite cannot start with parameters the checkpoint lacks "
             "(missing tensors always stop the load)")
    for name in ("save_retain_interval", "non_persistent_save_interval", "ckpt_step"):
        value = getattr(args, name)
        if value is not None and value < (0 if name == "ckpt_step" else 1):
            fail(f"--{name.replace('_', '-')} must be positive, got {value}")
    if args.save_retain_interval is not None and args.save is None:
        fail("--save-retain-interval needs --save")
    if args.non_persistent_save_interval is not None:
        kind = args.non_persistent_ckpt_type
        if kind is None:
            fail("--non-persistent-save-interval needs --non-persistent-ckpt-type (global or local)")
        if kind == "local" and not args.non_persistent_local_ckpt_dir:
            fail("--non-persistent-ckpt-type local needs --non-persistent-local-ckpt-dir")
        if kind == "global" and not (args.non_persistent_global_ckpt_dir or args.save):
            fail("--non-persistent-ckpt-type global needs --save or --non-persistent-global-ckpt-dir")
    if args.ckpt_step is not None and args.load is None:
        fail("--ckpt-step needs --load")
    if args.verify_integrity and args.ckpt_format == "torch":
        fail("--verify-integrity needs --ckpt-format torch_dist (Megatron hashes only torch_dist checkpoints)")
    if args.verify_integrity and not (args.save or args.load or args.pretrained_checkpoint):
        fail("--verify-integrity needs --save or --load (there is no checkpoint to hash)")


def checkpoint_flag_notes(args) -> list[str]:
    """One start-up line for each flag megalite serves another way."""
    notes = []
    if args.save_interval is not None and args.save is None:
        notes.append(f"--save-interval {args.save_interval}: no effect without --save (nothing is saved; "
                     "Megatron accepts it and saves nothing too)")
    if args.ckpt_format == "torch":
        notes.append("--ckpt-format torch: --load reads Megatron's legacy iter_*/mp_rank_* files; --save writes "
                     "megalite's torch_dist (DCP) checkpoints, which reshard on load")
    if args.use_persistent_ckpt_worker:
        notes.append("--use-persistent-ckpt-worker: megalite's --async-save writes from a background thread of "
                     "the training process, so there is no worker process to keep")
    given = [f for f, on in (("--async-strategy", args.async_strategy is not None),
                             ("--async-ckpt-use-cpu-shm", args.async_ckpt_use_cpu_shm)) if on]
    if given and not args.async_save:
        notes.append(f"{given[0]}: no effect without --async-save (as in Megatron)")
    elif given:
        notes.append(f"--async-save (--async-strategy {args.async_strategy or 'nvrx'}"
                     + (", --async-ckpt-use-cpu-shm" if args.async_ckpt_use_cpu_shm else "")
                     + "): megalite's background writer is PyTorch DCP's async_save in a thread of the training "
                     "process, which first copies the tensors to CPU memory; there is no NVRx or Megatron worker "
                     "process and so no CUDA IPC for shared memory to avoid")
    if args.ckpt_fully_parallel_load:
        notes.append("--ckpt-fully-parallel-load: every rank reads only the tensor elements its own layout "
                     "holds from megalite's checkpoints (no rank reads the whole checkpoint)")
    if args.ckpt_assume_constant_structure:
        notes.append("--ckpt-assume-constant-structure: DCP reuses the first save's plan (enable_plan_caching)")
    if args.dist_ckpt_optim_fully_reshardable:
        notes.append("--dist-ckpt-optim-fully-reshardable: megalite's optimizer state is always saved by full "
                     "parameter shape and loads at any TP/PP/DP layout")
    if args.non_persistent_local_ckpt_algo != "fully_parallel" and args.non_persistent_ckpt_type == "local":
        notes.append(f"--non-persistent-local-ckpt-algo {args.non_persistent_local_ckpt_algo}: local checkpoints "
                     "are published atomically (written to a temporary folder, then renamed)")
    return notes


def apply_checkpoint_args(args, stored: dict | None) -> list[str]:
    """--use-checkpoint-args: copy the model arguments `stored` with the checkpoint under --load
    (megalite.checkpoint.run_load.checkpoint_args_of) into `args`, before validation; the lines
    saying what was set."""
    if not (args.use_checkpoint_args and args.load):
        return []
    if stored is None:
        raise ValueError(f"--use-checkpoint-args: no checkpoint with arguments under --load {args.load}")
    stored, lines = dict(stored), []
    if "add_bias_linear" in stored and hasattr(args, "disable_bias_linear"):
        stored["disable_bias_linear"] = not stored["add_bias_linear"]
    for field, forced in CHECKPOINT_MODEL_ARGS + (("disable_bias_linear", True),):
        if not hasattr(args, field) or stored.get(field) is None or (not forced and getattr(args, field) is not None):
            continue
        if getattr(args, field) != stored[field]:
            lines.append(f"--use-checkpoint-args: {field} = {stored[field]!r} from the checkpoint")
        setattr(args, field, stored[field])
    return lines
