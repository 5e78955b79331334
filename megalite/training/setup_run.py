"""Everything a training run needs, built from its arguments in the order that matters:
options checked before any process group; model weights loaded before the optimizer (whose
fp32 main parameters start from them); optimizer state loaded after it is built."""

import logging
import os
import socket
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megalite.data import build_data_iterator, build_gpt_datasets, megatron_num_samples
from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step
from megalite.optimizer.memory_report import memory_report
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.data.fsdp import apply_fsdp2
from megalite.parallel.expert.groups import ExpertState
from megalite.parallel.pipeline.executor import PipelineExecutor, unwrap
from megalite.parallel.random import seed_everything
from megalite.parallel.state import ParallelState
from megalite.config.arguments import layout_from_args, model_config_from_args, validate_args
from megalite.config.arguments_megatron_checkpoint import checkpoint_flag_notes
from megalite.config.arguments_megatron_data import megatron_data_notes
from megalite.config.arguments_megatron_logging import megatron_logging_notes
from megalite.config.arguments_megatron_model import start_up_notes, tokenizer_from_args
from megalite.config.arguments_megatron_training import interleaved_group_size, megatron_training_notes
from megalite.config.schedules import batch_schedule_from_args
from megalite.training.flops import flops_per_token, peak_flops
from megalite.training.lr_schedule import lr_scheduler_from_args
from megalite.training.per_token_loss import PerTokenLoss, apply_decoupled_lr
from megalite.training.run_hooks import apply_deterministic_mode
from megalite.checkpoint.run_load import apply_checkpoint_args, load_for_run, resume_optimizer

log = logging.getLogger(__name__)


@dataclass
class Run:
    args: object
    pstate: ParallelState
    device: torch.device
    tracker: object
    tokenizer: object
    config: object
    chunks: list  # DistributedDataParallel / FSDPChunk wrappers, one per model chunk
    optimizer: object  # None with --skip-train (only evaluation)
    scheduler: object  # None with --skip-train
    executor: PipelineExecutor
    flops_per_token: float
    peak_flops: float | None
    iteration: int = 0
    consumed_train_samples: int = 0
    consumed_valid_samples: int = 0
    loaded_from: str | None = None
    make_executor: object = None  # micro-batch count -> PipelineExecutor (rampup, eval batches)
    per_token: PerTokenLoss | None = None  # --calculate-per-token-loss's forward step
    executors: dict = field(default_factory=dict)

    def executor_for(self, num_microbatches: int) -> PipelineExecutor:
        """The executor of steps of `num_microbatches` micro-batches (built once per count)."""
        if num_microbatches == self.executor.num_microbatches:
            return self.executor
        if num_microbatches not in self.executors:
            self.executors[num_microbatches] = self.make_executor(num_microbatches)
        return self.executors[num_microbatches]

    @property
    def models(self) -> list:
        return [unwrap(c) for c in self.chunks]

    @property
    def writes_logs(self) -> bool:
        """The last pipeline stage's first TP, CP and DP rank reports (it holds the loss)."""
        ps = self.pstate
        return ps.is_last_stage and ps.tp_rank == 0 and ps.cp_rank == 0 and ps.dp_rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_distributed(args) -> tuple[ParallelState, torch.device]:
    """Validate the options, then join the process group and build the parallel state."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    validate_args(args, world)
    layout = layout_from_args(args, world)  # refuses impossible layouts before any group exists
    backend = args.distributed_backend or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if world > 1:
            raise ValueError("MASTER_PORT is not set: launch with torchrun or srun (scripts/pretrain_gpt.sh)")
        os.environ["MASTER_PORT"] = str(_free_port())  # a lone process needs no agreed port
    dist.init_process_group(backend, rank=rank, world_size=world,
                            timeout=timedelta(minutes=args.distributed_timeout_minutes))
    return ParallelState.create(layout, args.distributed_timeout_minutes), device


def _dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def _wrap(models, args, pstate):
    if args.use_torch_fsdp2:
        return [apply_fsdp2(m, pstate, param_dtype=_dtype(args)) for m in models]
    grad_dtype = torch.float16 if args.fp16 and not args.accumulate_allreduce_grads_in_fp32 else torch.float32
    if args.grad_reduce_in_bf16:
        grad_dtype = torch.bfloat16
    return [DistributedDataParallel(m, pstate, bucket_size=args.ddp_bucket_size,
                                    overlap_grad_reduce=args.overlap_grad_reduce,
                                    use_distributed_optimizer=args.use_distributed_optimizer, grad_dtype=grad_dtype)
            for m in models]


def startup_notes(args, device_type: str = "cpu") -> list[str]:
    """One line for each Megatron flag megalite serves another way or that has no effect here
    (`device_type`: where the model runs, which decides how --attention-backend is served)."""
    notes = []
    if args.sequence_parallel and args.tensor_model_parallel_size == 1:
        notes.append("--sequence-parallel: no effect at --tensor-model-parallel-size 1 (nothing to split "
                     "the sequence over); running without it, as Megatron does")
    return (notes + start_up_notes(args, device_type) + megatron_training_notes(args) + megatron_data_notes(args)
            + megatron_logging_notes(args) + checkpoint_flag_notes(args))


def build_run(args) -> Run:
    checkpoint_notes = apply_checkpoint_args(args)  # --use-checkpoint-args, before validation
    if args.deterministic_mode:
        apply_deterministic_mode()
    pstate, device = init_distributed(args)
    if args.num_experts is not None:
        pstate.expert = ExpertState.create(pstate, args.expert_model_parallel_size, args.num_experts,
                                           args.distributed_timeout_minutes, args.expert_tensor_parallel_size)
    if pstate.rank == 0:
        for note in checkpoint_notes + startup_notes(args, device.type):
            print(note, flush=True)
    tracker = seed_everything(args.seed, pstate.tp_rank, pstate.pp_rank, device)
    tokenizer = tokenizer_from_args(args)
    config = model_config_from_args(args, tokenizer.vocab_size)
    if args.use_torch_fsdp2:
        config = config.replace(params_dtype="float32")  # FSDP2 keeps fp32 shards, computes in bf16/fp16
    models = build_model_chunks(config, pstate, num_layers_first=args.decoder_first_pipeline_num_layers,
                                num_layers_last=args.decoder_last_pipeline_num_layers, rng_tracker=tracker,
                                init_seed=args.seed, device=device, init_on_shard=args.init_on_shard)
    if args.torch_compile:
        for model in models:
            for layer in model.layers.values():
                layer.compile()
    common = None
    if args.load or args.pretrained_checkpoint:
        common = load_for_run(args, models, pstate, tracker)
        if common is None and pstate.rank == 0:
            log.warning("no checkpoint under --load %s: starting from scratch", args.load)
    chunks = _wrap(models, args, pstate)
    optimizer = scheduler = None
    if not args.skip_train:
        optimizer, scheduler = _build_optimizer(chunks, args, pstate)
    per_token = PerTokenLoss() if args.calculate_per_token_loss else None

    def make_executor(num_microbatches: int) -> PipelineExecutor:
        return PipelineExecutor(
            chunks, pstate, args.pipeline_schedule, num_microbatches=num_microbatches,
            seq_length=args.seq_length, micro_batch_size=args.micro_batch_size, hidden_size=config.hidden_size,
            sequence_parallel=config.sequence_parallel, dtype=_dtype(args), device=device,
            forward_step=per_token or gpt_forward_step, microbatch_group_size=interleaved_group_size(args))

    executor = make_executor(args.num_micro_batches)
    peak = peak_flops() if device.type == "cuda" else None
    run = Run(args, pstate, device, tracker, tokenizer, config, chunks, optimizer, scheduler, executor,
              flops_per_token(config, args.seq_length, config.padded_vocab_size(pstate.tp_size)),
              peak[1] if peak else None, make_executor=make_executor, per_token=per_token)
    if common is not None:
        run.loaded_from = common["path"]
        if not (args.finetune or common["finetune"]):
            run.iteration = common["iteration"]
            run.consumed_train_samples = common.get("consumed_train_samples", 0)
            run.consumed_valid_samples = common.get("consumed_valid_samples", 0)
            if not args.no_load_optim and optimizer is not None:
                resume_optimizer(common, chunks=models, optimizer=optimizer, scheduler=scheduler, args=args,
                                 pstate=pstate)
    info, line = memory_report(chunks, optimizer, pstate)
    if pstate.dp_rank == 0:
        print(line, flush=True)
    return run


def _build_optimizer(chunks, args, pstate):
    """The optimizer and its learning-rate scheduler (not built with --skip-train, which
    needs neither --lr nor --train-iters)."""
    optimizer = build_optimizer(
        chunks, pstate, optimizer=args.optimizer, lr=args.lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        sgd_momentum=args.sgd_momentum, clip_grad=args.clip_grad, fp16=args.fp16,
        bf16=args.bf16 and not args.use_torch_fsdp2, loss_scale=args.loss_scale,
        initial_loss_scale=args.initial_loss_scale, min_loss_scale=args.min_loss_scale,
        loss_scale_window=args.loss_scale_window, hysteresis=args.hysteresis,
        use_distributed_optimizer=args.use_distributed_optimizer, overlap_param_gather=args.overlap_param_gather,
        cpu_offload=args.optimizer_cpu_offload, log_num_zeros_in_grad=args.log_num_zeros_in_grad)
    if args.decoupled_lr is not None:
        apply_decoupled_lr(optimizer, args.decoupled_lr, args.decoupled_min_lr)
    return optimizer, lr_scheduler_from_args(args, optimizer)


def build_data(run: Run):
    """(train, valid, test) datasets on the ranks that read data; Nones elsewhere."""
    args, pstate = run.args, run.pstate
    if not (pstate.is_first_stage or pstate.is_last_stage):
        return None, None, None
    train_iters = run.args.total_train_iters
    num_samples = megatron_num_samples(train_iters, args.eval_interval, args.eval_iters, args.global_batch_size)
    eval_batch = args.eval_global_batch_size or args.global_batch_size
    if eval_batch != args.global_batch_size or args.rampup_batch_size or args.step_batch_size_schedule:
        train = args.train_samples if args.train_samples is not None else (
            batch_schedule_from_args(args).samples(train_iters))
        num_samples = (train, *megatron_num_samples(train_iters, args.eval_interval, args.eval_iters, eval_batch)[1:])
    return build_gpt_datasets(
        data_path=args.data_path, train_data_path=args.train_data_path, valid_data_path=args.valid_data_path,
        test_data_path=args.test_data_path, split=args.split, seq_length=args.seq_length, seed=args.seed,
        num_samples=num_samples, cache_path=args.data_cache_path, mock_data=args.mock_data,
        eod_token=run.tokenizer.eod, vocab_size=run.tokenizer.vocab_size, eod_mask_loss=args.eod_mask_loss,
        reset_position_ids=args.reset_position_ids, reset_attention_mask=args.reset_attention_mask,
        mmap_bin_files=not args.no_mmap_bin_files)


def data_iterator(run: Run, dataset, consumed_samples: int):
    """Micro-batches for this rank, on its device; None where no data is needed."""
    source = build_data_iterator(dataset, consumed_samples=consumed_samples, micro_batch_size=run.args.micro_batch_size,
                                 global_batch_size=run.args.global_batch_size, pstate=run.pstate,
                                 num_workers=run.args.num_workers, seed=run.args.seed, device=run.device)
    if source is None:
        return None
    return ({k: v.to(run.device, non_blocking=True) for k, v in batch.items()} for batch in source)
