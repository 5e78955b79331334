"""Megatron-LM's logging flags: TensorBoard scalars, progress.txt, timers, wandb entity.

Names and defaults are Megatron-LM's (LoggerConfig in megatron/training/config). The
TensorBoard tags are Megatron's ('lm loss', 'learning-rate', 'loss-scale', ...; see
megalite/training/tensorboard_log.py).
"""

from dataclasses import dataclass

from megalite.config.field import arg, on_cpu

TIMING_LOG_OPTIONS = ("max", "minmax", "all")


@dataclass
class MegatronLoggingArgs:
    """Megatron's logging options."""

    log_num_zeros_in_grad: bool = arg(
        False, "Log the number of zero gradient elements of the whole model ('num zeros').")
    log_validation_ppl_to_tensorboard: bool = arg(
        False, "Write the validation perplexity to TensorBoard ('lm loss validation ppl').")
    log_timers_to_tensorboard: bool = arg(
        False, "Write the iteration time and the --timing-log-level timers to TensorBoard.")
    log_memory_to_tensorboard: bool = arg(
        False, "Write memory use to TensorBoard (CUDA allocator statistics; peak RSS on CPU).")
    log_world_size_to_tensorboard: bool = arg(False, "Write the world size to TensorBoard.")
    log_loss_scale_to_tensorboard: bool | None = arg(
        True, "Write the loss scale to TensorBoard.", negative_flag="--no-log-loss-scale-to-tensorboard")
    log_batch_size_to_tensorboard: bool = arg(
        False, "Older Megatron's switch for the 'batch-size' scalar, which Megatron-LM now writes at every "
        "TensorBoard log step, as megalite does: it changes nothing (one start-up line says so).")
    log_learning_rate_to_tensorboard: bool | None = arg(
        True, "Write the learning rate to TensorBoard.",
        negative_flag="--no-log-learning-rate-to-tensorboard")
    tensorboard_log_interval: int = arg(1, "Write TensorBoard scalars every this many iterations.")
    tensorboard_queue_size: int = arg(
        1000, "TensorBoard events kept in memory before a write forces a flush to disk.")
    log_progress: bool = arg(
        False, "Append Megatron's progress lines (job start; each checkpoint's iteration, "
        "throughput, floating-point operations and tokens) to <save>/progress.txt.")
    wandb_entity: str | None = arg(None, "Weights & Biases entity (team or user) of the run.")
    timing_log_option: str = arg(
        "minmax", "How timers are reported across ranks: max, minmax or all (every rank).",
        choices=TIMING_LOG_OPTIONS)
    log_straggler: bool = arg(
        False, "Every --log-interval, report each rank's time per iteration and name the "
        "slowest and fastest rank.")


def check_megatron_logging_args(args, fail) -> None:
    for name in ("tensorboard_log_interval", "tensorboard_queue_size"):
        if getattr(args, name) <= 0:
            fail(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.wandb_entity and not args.wandb_project:
        fail("--wandb-entity needs --wandb-project")


def megatron_logging_notes(args) -> list[str]:
    """Megatron writes nothing for these without --save / --tensorboard-dir; neither does megalite,
    but it says so."""
    notes = []
    if args.log_progress and not args.save:
        notes.append("--log-progress: no --save, so no progress.txt is written (as in Megatron)")
    tensorboard_only = [f for f in ("log_validation_ppl_to_tensorboard", "log_timers_to_tensorboard",
                                    "log_memory_to_tensorboard", "log_world_size_to_tensorboard",
                                    "log_batch_size_to_tensorboard") if getattr(args, f)]
    if tensorboard_only and not args.tensorboard_dir:
        notes.append(f"--{tensorboard_only[0].replace('_', '-')}: no --tensorboard-dir, so no TensorBoard "
                     "scalars are written (as in Megatron)")
    if args.log_batch_size_to_tensorboard and args.tensorboard_dir:
        notes.append("--log-batch-size-to-tensorboard: 'batch-size' and 'batch-size vs samples' are written at every "
                     "TensorBoard log step anyway, as Megatron-LM writes them (it no longer has this flag)")
    if args.log_memory_to_tensorboard and on_cpu(args):
        notes.append("--log-memory-to-tensorboard: on CPU megalite writes the process's peak RSS "
                     "as 'mem-max-rss-bytes' (the CUDA allocator statistics need a GPU)")
    return notes
