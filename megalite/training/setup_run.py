"""Everything a training run needs, built from its typed config in the order that matters:
options checked and typed before any process group; model weights loaded before the optimizer (whose
fp32 main parameters start from them); optimizer state loaded after it is built."""

import logging
import os
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist

from megalite.checkpoint.run_load import checkpoint_args_of, load_for_run, resume_optimizer
from megalite.config.megatron.checkpoint import apply_checkpoint_args
from megalite.config.run_config import OptimizerConfig, ParallelConfig, RunConfig, run_config
from megalite.data import build_data_iterator, build_gpt_datasets, megatron_num_samples
from megalite.kernels.gated_delta_fla import run_chunk_rule_line
from megalite.model.attention_kernels import run_start_up_line
from megalite.model.fp8 import enable_fp8_chunks
from megalite.model.pipeline_chunks import build_model_chunks, gpt_forward_step
from megalite.optimizer.memory_report import memory_report
from megalite.optimizer.mixed_precision import build_optimizer
from megalite.optimizer.muon_mixed import build_muon_optimizer, qkv_split_of
from megalite.parallel.data.ddp import DistributedDataParallel
from megalite.parallel.data.fsdp import apply_fsdp2
from megalite.parallel.expert.groups import ExpertState
from megalite.parallel.pipeline.executor import PipelineExecutor, unwrap
from megalite.parallel.random import seed_everything
from megalite.parallel.spawn import free_port
from megalite.parallel.state import ParallelState
from megalite.training.cuda_graphs import layer_graphs_for
from megalite.parallel.tensor.comm_overlap import enable_tp_comm_overlap
from megalite.parallel.tensor.deferred_wgrad import defer_wgrad
from megalite.training.flops import flops_per_token, run_peak_flops
from megalite.training.lr_schedule import lr_scheduler
from megalite.optimizer.mup import apply_mup
from megalite.training.per_token_loss import PerTokenLoss, apply_decoupled_lr
from megalite.training.run_hooks import apply_deterministic_mode

log = logging.getLogger(__name__)


@dataclass
class Run:
    config: RunConfig
    pstate: ParallelState
    device: torch.device
    tracker: object
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
    rerun_record: dict | None = None  # the loaded checkpoint's record of a reproduced fault (--rerun-mode)
    checkpoint_layout: dict | None = None  # the loaded megalite checkpoint's parallel layout
    make_executor: object = None  # micro-batch count -> PipelineExecutor (rampup, eval batches)
    per_token: PerTokenLoss | None = None  # --calculate-per-token-loss's forward step
    executors: dict = field(default_factory=dict)
    cuda_graphs: list = field(default_factory=list)  # --cuda-graph-impl local: LayerGraphs per chunk
    fp8_scaling: object = None  # --fp8-format: DelayedScalingStates, updated after each optimizer step
    peak_fp8_flops: float | None = None  # --fp8-format on a card with a known FP8 peak: MFU against it too

    def optimizer_step(self, iteration: int) -> tuple[bool, float | None, int | None]:
        """The optimizer's step, then the FP8 delayed-scaling update (also after a skipped
        step, as Transformer Engine updates whether or not the optimizer applied the gradients)."""
        result = self.optimizer.step(iteration=iteration)
        if self.fp8_scaling is not None:
            self.fp8_scaling.after_optimizer_step()
        return result

    @property
    def tokenizer(self):
        return self.config.tokenizer

    @property
    def model_config(self):
        return self.config.model

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


def init_distributed(parallel: ParallelConfig) -> tuple[ParallelState, torch.device]:
    """Join the process group (the options already validated) and build the parallel state."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if parallel.backend == "nccl":
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "MASTER_PORT" not in os.environ:
        if world > 1:
            raise ValueError("MASTER_PORT is not set: launch with torchrun or srun (scripts/pretrain_gpt.sh)")
        os.environ["MASTER_PORT"] = str(free_port())  # a lone process needs no agreed port
    dist.init_process_group(parallel.backend, rank=rank, world_size=world,
                            timeout=timedelta(minutes=parallel.distributed_timeout_minutes))
    return ParallelState.create(parallel.layout, parallel.distributed_timeout_minutes), device


def wrap_chunks(models, parallel: ParallelConfig, pstate):
    """Each model chunk with its tensor-parallel options (--tp-comm-overlap,
    --defer-embedding-wgrad-compute) in its data-parallel wrapper: FSDP2, or megalite's DDP."""
    for model in models:
        if parallel.tp_comm_overlap is not None:
            enable_tp_comm_overlap(model, parallel.tp_comm_overlap)
        if parallel.defer_embedding_wgrad_compute and model.post_process:
            defer_wgrad(model.output_layer, parallel.wgrad_deferral_limit)
    if parallel.use_torch_fsdp2:
        return [apply_fsdp2(m, pstate, param_dtype=parallel.compute_dtype, reduce_dtype=parallel.fsdp2_reduce_dtype,
                            reshard_after_forward=parallel.fsdp2_reshard_after_forward) for m in models]
    return [DistributedDataParallel(m, pstate, bucket_size=parallel.ddp_bucket_size,
                                    overlap_grad_reduce=parallel.overlap_grad_reduce,
                                    use_distributed_optimizer=parallel.use_distributed_optimizer,
                                    grad_dtype=parallel.grad_reduce_dtype,
                                    disable_bucketing=parallel.overlap_param_gather_with_optimizer_step,
                                    gradient_accumulation_fusion=parallel.gradient_accumulation_fusion)
            for m in models]


def build_run(args) -> Run:
    """The run `args` describe: the options typed (megalite.config.run_config), then built."""
    checkpoint_notes = []
    if args.use_checkpoint_args and args.load:  # before validation, as Megatron applies them
        checkpoint_notes = apply_checkpoint_args(args, checkpoint_args_of(args.load))
    cfg = run_config(args, int(os.environ.get("WORLD_SIZE", "1")))
    if cfg.training.deterministic_mode:
        apply_deterministic_mode()
    parallel = cfg.parallel
    pstate, device = init_distributed(parallel)
    if parallel.num_experts is not None:
        pstate.expert = ExpertState.create(pstate, parallel.expert_model_parallel_size, parallel.num_experts,
                                           parallel.distributed_timeout_minutes, parallel.expert_tensor_parallel_size)
    if pstate.rank == 0:
        attention = run_start_up_line(cfg.model, device, seq_length=cfg.data.seq_length, dtype=parallel.compute_dtype,
                                      masked=cfg.data.reset_attention_mask,
                                      deterministic=cfg.training.deterministic_mode,
                                      context_parallel=parallel.layout.context)
        chunk_rule = run_chunk_rule_line(cfg.model.gdn, device)  # after apply_deterministic_mode
        for note in checkpoint_notes + list(cfg.notes) + [line for line in (attention, chunk_rule) if line]:
            print(note, flush=True)
    tracker = seed_everything(cfg.training.seed, pstate.tp_rank, pstate.pp_rank, device)
    config = cfg.model
    models = build_model_chunks(config, pstate, num_layers_first=parallel.decoder_first_pipeline_num_layers,
                                num_layers_last=parallel.decoder_last_pipeline_num_layers, rng_tracker=tracker,
                                init_seed=cfg.training.seed, device=device, init_on_shard=parallel.init_on_shard,
                                embedding_stage=parallel.pipeline_embedding_stage, loss_stage=parallel.pipeline_loss_stage,
                                layout_counts=parallel.pipeline_layout_counts)
    fp8_scaling = enable_fp8_chunks(models, cfg.fp8, config.num_layers, pstate)  # before a load: its state loads too
    if parallel.torch_compile:
        for model in models:
            model.compile_regions()
    ckpt = cfg.checkpoint
    common = None
    if ckpt.load or ckpt.pretrained_checkpoint:
        common = load_for_run(ckpt, models, pstate, tracker)
        if common is None and pstate.rank == 0:
            log.warning("no checkpoint under --load %s: starting from scratch", ckpt.load)
    chunks = wrap_chunks(models, parallel, pstate)
    optimizer = scheduler = None
    if not cfg.training.skip_train:
        optimizer, scheduler = build_optimizer_and_schedule(chunks, cfg.optimizer, pstate)
    per_token = PerTokenLoss() if cfg.training.calculate_per_token_loss else None
    data = cfg.data

    def make_executor(num_microbatches: int) -> PipelineExecutor:
        return PipelineExecutor(
            chunks, pstate, parallel.pipeline_schedule, num_microbatches=num_microbatches,
            seq_length=data.seq_length, micro_batch_size=data.micro_batch_size, hidden_size=config.hidden_size,
            sequence_parallel=config.sequence_parallel, dtype=parallel.compute_dtype, device=device,
            forward_step=per_token or gpt_forward_step, microbatch_group_size=parallel.microbatch_group_size)

    executor = make_executor(parallel.num_micro_batches)
    peak, peak_fp8 = run_peak_flops(cfg.fp8 is not None) if device.type == "cuda" else (None, None)
    run = Run(cfg, pstate, device, tracker, chunks, optimizer, scheduler, executor,
              flops_per_token(config, data.seq_length, config.padded_vocab_size(pstate.tp_size)),
              peak, make_executor=make_executor, per_token=per_token,
              cuda_graphs=layer_graphs_for(models, cfg.training.cuda_graph_impl, cfg.training.cuda_graph_warmup_steps),
              fp8_scaling=fp8_scaling, peak_fp8_flops=peak_fp8)
    if common is not None:
        run.loaded_from = common["path"]
        if not (ckpt.finetune or common["finetune"]):
            run.rerun_record, run.checkpoint_layout = common.get("rerun_state_machine"), common.get("layout")
            run.iteration = common["iteration"]
            run.consumed_train_samples = common.get("consumed_train_samples", 0)
            run.consumed_valid_samples = common.get("consumed_valid_samples", 0)
            if not ckpt.no_load_optim and optimizer is not None:
                resume_optimizer(common, ckpt, chunks=models, optimizer=optimizer,
                                 scheduler=scheduler, pstate=pstate)
    info, line = memory_report(chunks, optimizer, pstate)
    if pstate.dp_rank == 0:
        print(line, flush=True)
    return run


def build_optimizer_and_schedule(chunks, optim: OptimizerConfig, pstate):
    """The optimizer and its learning-rate scheduler (not built with --skip-train, which
    needs neither --lr nor --train-iters)."""
    if optim.muon is not None:
        optimizer = build_muon_optimizer(
            chunks, pstate, lr=optim.lr, weight_decay=optim.weight_decay, adam_beta1=optim.adam_beta1,
            adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps, clip_grad=optim.clip_grad,
            bf16=optim.bf16_main_params, log_num_zeros_in_grad=optim.log_num_zeros_in_grad,
            use_distributed_optimizer=optim.use_distributed_optimizer, overlap_param_gather=optim.overlap_param_gather,
            qkv_split=qkv_split_of(unwrap(chunks[0]).config), **optim.muon)
        return optimizer, lr_scheduler(optim.lr_schedule, optimizer)
    optimizer = build_optimizer(
        chunks, pstate, optimizer=optim.optimizer, lr=optim.lr, weight_decay=optim.weight_decay,
        adam_beta1=optim.adam_beta1, adam_beta2=optim.adam_beta2, adam_eps=optim.adam_eps,
        sgd_momentum=optim.sgd_momentum, clip_grad=optim.clip_grad, fp16=optim.fp16, bf16=optim.bf16_main_params,
        loss_scale=optim.loss_scale, initial_loss_scale=optim.initial_loss_scale,
        min_loss_scale=optim.min_loss_scale, loss_scale_window=optim.loss_scale_window,
        hysteresis=optim.hysteresis, use_distributed_optimizer=optim.use_distributed_optimizer,
        overlap_param_gather=optim.overlap_param_gather, cpu_offload=optim.optimizer_cpu_offload,
        log_num_zeros_in_grad=optim.log_num_zeros_in_grad,
        overlap_param_gather_with_optimizer_step=optim.overlap_param_gather_with_optimizer_step,
        apply_wd_to_qk_layernorm=optim.apply_wd_to_qk_layernorm)
    if optim.decoupled_lr is not None:
        apply_decoupled_lr(optimizer, optim.decoupled_lr, optim.decoupled_min_lr)
    apply_mup(optimizer, optim.mup_width_mult, lr=optim.lr, min_lr=optim.lr_schedule.min_lr, adam_eps=optim.adam_eps)
    return optimizer, lr_scheduler(optim.lr_schedule, optimizer)


def build_data(run: Run):
    """(train, valid, test) datasets on the ranks that read data; Nones elsewhere."""
    data, pstate = run.config.data, run.pstate
    if not (pstate.is_first_stage or pstate.is_last_stage):
        return None, None, None
    train_iters = data.total_train_iters
    num_samples = megatron_num_samples(train_iters, data.eval_interval, data.eval_iters, data.global_batch_size)
    eval_batch = data.eval_batch_size
    if eval_batch != data.global_batch_size or data.batch_schedule.varies:
        train = data.train_samples if data.train_samples is not None else data.batch_schedule.samples(train_iters)
        num_samples = (train, *megatron_num_samples(train_iters, data.eval_interval, data.eval_iters, eval_batch)[1:])
    return build_gpt_datasets(
        data_path=data.data_path, train_data_path=data.train_data_path, valid_data_path=data.valid_data_path,
        test_data_path=data.test_data_path, split=data.split, seq_length=data.seq_length, seed=data.seed,
        num_samples=num_samples, cache_path=data.data_cache_path, mock_data=data.mock_data,
        eod_token=run.tokenizer.eod, vocab_size=run.tokenizer.vocab_size, eod_mask_loss=data.eod_mask_loss,
        reset_position_ids=data.reset_position_ids, reset_attention_mask=data.reset_attention_mask,
        mmap_bin_files=data.mmap_bin_files, sample_transform=data.fim)


def data_iterator(run: Run, dataset, consumed_samples: int):
    """Micro-batches for this rank, on its device; None where no data is needed."""
    data = run.config.data
    source = build_data_iterator(dataset, consumed_samples=consumed_samples, micro_batch_size=data.micro_batch_size,
                                 global_batch_size=data.global_batch_size, pstate=run.pstate,
                                 num_workers=data.num_workers, seed=data.seed, device=run.device)
    if source is None:
        return None
    return ({k: v.to(run.device, non_blocking=True) for k, v in batch.items()} for batch in source)
