"""Options for the batch, LR schedule, optimizer, data, logging and checkpoints.

Names and defaults are Megatron-LM's; each field's metadata holds its help text (see
field.arg). `DerivedArgs` holds values validate_args fills in; they are not flags.
"""

from dataclasses import dataclass

from megalite.data.tokenizers import TOKENIZER_TYPES
from megalite.config.field import MEGALITE, arg

DECAY_STYLES = ("constant", "linear", "cosine", "inverse-square-root", "WSD")
WSD_DECAY_STYLES = ("exponential", "linear", "cosine", "minus_sqrt")


@dataclass
class TrainingArgs:
    """Batch size, iterations, learning-rate schedule and optimizer."""

    micro_batch_size: int | None = arg(None, "Sequences per micro-batch b on one rank.")
    global_batch_size: int | None = arg(
        None, "Sequences per optimizer step B = b x DP x micro-batches (default b x DP).")
    rampup_batch_size: list[str] | None = arg(
        None, "Megatron's batch-size ramp-up: START INCREMENT SAMPLES (the global batch grows from "
        "START by INCREMENT over SAMPLES samples; needs --train-samples).")
    train_iters: int | None = arg(None, "Optimizer steps to train for (or --train-samples).")
    train_samples: int | None = arg(None, "Samples to train for (or --train-iters).")
    lr: float | None = arg(None, "Peak learning rate.")
    min_lr: float = arg(0.0, "Learning rate at the end of the decay.")
    lr_decay_style: str = arg("linear", "Learning-rate decay after warmup.", choices=DECAY_STYLES)
    lr_decay_iters: int | None = arg(None, "Iterations over which lr decays (default --train-iters).")
    lr_decay_samples: int | None = arg(
        None, "Samples over which lr decays (default --train-samples).")
    lr_warmup_iters: int = arg(0, "Iterations of linear warmup.")
    lr_warmup_samples: int = arg(0, "Samples of linear warmup (with --train-samples).")
    lr_warmup_fraction: float | None = arg(None, "Warmup as a fraction of the decay length.")
    lr_warmup_init: float = arg(0.0, "Learning rate at the start of warmup.")
    lr_wsd_decay_style: str = arg(
        "exponential", "Shape of the final decay of the WSD schedule.", choices=WSD_DECAY_STYLES)
    lr_wsd_decay_iters: int | None = arg(None, "Iterations of the final WSD decay.")
    lr_wsd_decay_samples: int | None = arg(None, "Samples of the final WSD decay.")
    weight_decay: float = arg(0.01, "Decoupled weight decay (AdamW) / L2 (SGD).")
    adam_beta1: float = arg(0.9, "Adam beta1.")
    adam_beta2: float = arg(0.999, "Adam beta2.")
    adam_eps: float = arg(1e-8, "Adam epsilon.")
    sgd_momentum: float = arg(0.9, "SGD momentum.")
    clip_grad: float = arg(1.0, "Clip the global gradient norm to this (0 disables).")
    optimizer: str = arg("adam", "Optimizer (dist_muon: Megatron's deprecated name of muon with the distributed "
                         "optimizer).", choices=("adam", "sgd", "muon", "dist_muon", "lion", "soap", "adaptive_muon"),
                         unsupported=("lion", "soap", "adaptive_muon"))
    label_smoothing: float = arg(0.0, "Label smoothing of the cross-entropy loss.")
    seed: int = arg(1234, "Random seed.")
    skip_train: bool = arg(False, "Only evaluate (validation and test) and exit.")
    exit_interval: int | None = arg(None, "Save and exit when the iteration is a multiple of this.")
    exit_duration_in_mins: float | None = arg(
        None, "Save and exit after this many minutes, counted as Megatron counts them: from the "
        "start of the earliest rank's process (start-up and checkpoint loading included), checked "
        "after each iteration.")
    exit_reason_file: str | None = arg(
        None, "On a clean exit (status 0) rank 0 writes why the run stopped to this file: done, "
        "skip-train, exit-interval, exit-duration-in-mins, or 'signal SIGUSR1' / 'signal SIGTERM'. "
        "scripts/slurm/pretrain_gpt.sbatch requeues the job when it reads a SIGUSR1 stop.",
        origin=MEGALITE)
    exit_signal_handler: bool = arg(
        False, "Megatron's switch for saving and exiting on SIGTERM. megalite always does so, on "
        "SIGTERM and on SIGUSR1 (Slurm's warning before a time limit); the flag is accepted.")
    eval_interval: int = arg(1000, "Evaluate on the validation split every this many iterations.")
    eval_iters: int = arg(100, "Batches per evaluation.")


@dataclass
class DataArgs:
    """Data and tokenizer."""

    data_path: list[str] | None = arg(
        None, "One dataset prefix, or 'w1 p1 w2 p2 ...' to blend with weights.")
    split: str | None = arg(
        None, "Train/valid/test proportions of --data-path (default '969, 30, 1').")
    train_data_path: list[str] | None = arg(None, "Training dataset prefix(es), instead of --split.")
    valid_data_path: list[str] | None = arg(None, "Validation dataset prefix(es).")
    test_data_path: list[str] | None = arg(None, "Test dataset prefix(es).")
    data_cache_path: str | None = arg(None, "Directory for the dataset index caches.")
    mock_data: bool = arg(False, "Random tokens instead of a dataset.")
    num_workers: int = arg(2, "DataLoader worker processes.")
    tokenizer_type: str | None = arg(None, "Tokenizer.", choices=TOKENIZER_TYPES)
    vocab_file: str | None = arg(None, "GPT-2 BPE vocab.json.")
    merge_file: str | None = arg(None, "GPT-2 BPE merges.txt.")
    tokenizer_model: str | None = arg(
        None, "SentencePiece / tiktoken model file, or a Hugging Face tokenizer directory.")
    vocab_size: int | None = arg(None, "Vocabulary size of the NullTokenizer.")
    reset_position_ids: bool = arg(False, "Restart position ids after each end-of-document.")
    reset_attention_mask: bool = arg(False, "Do not attend across end-of-document tokens.")
    eod_mask_loss: bool = arg(False, "No loss on end-of-document tokens.")


@dataclass
class LoggingArgs:
    """Logging and metrics."""

    log_interval: int = arg(100, "Print the training line every this many iterations.")
    log_throughput: bool = arg(
        False, "Accepted for Megatron scripts; megalite always logs throughput and MFU.")
    timing_log_level: int = arg(
        0, "Timers printed every --log-interval as (min, max) over ranks in ms per iteration: "
        "0 none beyond the iteration time; 1 forward-backward, gradient sync, optimizer, "
        "evaluation and checkpoint saves. Megatron's 2 (per-message pipeline timers) is not "
        "implemented.", choices=(0, 1, 2), unsupported=(2,))
    log_params_norm: bool = arg(
        False, "Log the L2 norm of the fp32 main parameters of the whole model (each parameter "
        "counted once over TP, PP and DP) as 'params norm'.")
    tensorboard_dir: str | None = arg(None, "Write TensorBoard scalars here.")
    wandb_project: str | None = arg(None, "Weights & Biases project (enables wandb).")
    wandb_exp_name: str | None = arg(None, "Weights & Biases run name.")
    wandb_save_dir: str | None = arg(
        None, "Directory for wandb files (default <save>/wandb, else ./wandb).")
    metrics_file: str | None = arg(
        None, "JSON lines file: one object per logged iteration and per evaluation.",
        origin=MEGALITE)


@dataclass
class CheckpointArgs:
    """Checkpoints."""

    save: str | None = arg(None, "Directory to save checkpoints to.")
    load: str | None = arg(None, "Directory to load a checkpoint from.")
    save_interval: int | None = arg(None, "Save every this many iterations.")
    ckpt_format: str = arg(
        "dcp", "Checkpoint format: torch_dist (= dcp) is megalite's torch.distributed.checkpoint "
        "format, which --save writes; torch is Megatron's legacy iter_*/mp_rank_* files, which "
        "--load reads; fsdp_dtensor (with --use-megatron-fsdp) is written as torch_dist.",
        choices=("dcp", "torch_dist", "torch", "zarr", "fsdp_dtensor"), unsupported=("zarr",))
    async_save: bool = arg(False, "Write checkpoints in the background.")
    no_save_optim: bool = arg(False, "Do not save the optimizer state.")
    no_save_rng: bool = arg(False, "Do not save the random-number generator states.")
    no_load_optim: bool = arg(False, "Do not load the optimizer state.")
    no_load_rng: bool = arg(False, "Do not load the random-number generator states.")
    finetune: bool = arg(
        False, "Load only the model weights and start at iteration 0 (no optimizer, no RNG).")
    ckpt_fallback_to_previous: bool = arg(
        False, "When the latest checkpoint under --load is damaged, load the newest earlier one "
        "instead of stopping.", origin=MEGALITE)


@dataclass
class DerivedArgs:
    """Values validate_args derives from the options and the world size."""

    world_size: int | None = arg(None, "Number of processes.", cli=False)
    data_parallel_size: int | None = arg(None, "DP = world size / (t x p).", cli=False)
    virtual_pipeline_model_parallel_size: int = arg(
        1, "Model chunks per pipeline rank (1 without interleaving).", cli=False)
    num_micro_batches: int | None = arg(
        None, "Micro-batches per step per pipeline = B / (b x DP).", cli=False)
    total_train_iters: int | None = arg(
        None, "Iterations to train: --train-iters, or --train-samples // B; 0 with --skip-train.",
        cli=False)
