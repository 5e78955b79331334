"""Megatron-Core's own training state on CPU: its GPTModel at TP x PP=1 x DP in gloo processes,
wrapped in its DistributedDataParallel, stepped by its optimizer (get_megatron_optimizer: the
plain FP32Optimizer or the DistributedOptimizer, Adam being torch's AdamW as Megatron-Core picks
it without Transformer Engine or Apex) and its OptimizerParamScheduler, for STEPS_SAVED steps;
then saved as megatron/training/checkpointing.py's save_checkpoint writes it (megatron.training
is not part of the megatron-core package):

    torch       iter_NNNNNNN/mp_rank_TT/model_optim_rng.pt from DP rank 0 (generate_state_dict's
                keys; 'optimizer' = optimizer.state_dict()) and, with the distributed optimizer,
                distrib_optim.pt beside it (optimizer.save_parameter_state)
    torch_dist  dist_checkpointing.save of the same keys with the model's and the optimizer's
                sharded state dicts; the distributed optimizer in `sharding` ('dp_reshardable',
                Megatron's default, or 'fully_reshardable' for --dist-ckpt-optim-fully-reshardable)

and then STEPS_AFTER more steps: Megatron's own continuation, whose losses (DP means) go to
losses.pt (and each TP rank's torch RNG state at the save to torch_rng_tp<r>.pt). The vocabulary fills the padded embedding (VOCAB = PADDED_VOCAB): Megatron's loss
takes the padding rows into its softmax, megalite's leaves them out.
"""

import random
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from tests.checkpoint.megatron_core_fixture import PADDED_VOCAB, build_model, cpu_shims, megatron_args

VOCAB, SEQ, GLOBAL_BATCH, STEPS_SAVED, STEPS_AFTER, ITERATION = PADDED_VOCAB, 12, 4, 2, 3, 2
LR, MIN_LR, WARMUP, DECAY, WEIGHT_DECAY, CLIP = 3e-3, 3e-4, 1, 10, 0.1, 1.0  # warmup and decay in iterations


def batches() -> list[torch.Tensor]:
    """[GLOBAL_BATCH, SEQ + 1] token ids for every step: inputs [:, :-1], labels [:, 1:]."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ + 1), generator=g) for _ in range(STEPS_SAVED + STEPS_AFTER)]


def training_args(family: str, tp: int, dp: int, distributed: bool, fmt: str, sharding: str | None):
    """The Namespace such a Megatron run stores: the model's and the schedule's arguments."""
    return megatron_args(
        family, tensor_model_parallel_size=tp, pipeline_model_parallel_size=1, data_parallel_size=dp,
        world_size=tp * dp, vocab_size=VOCAB - 1, padded_vocab_size=PADDED_VOCAB, seq_length=SEQ,
        micro_batch_size=GLOBAL_BATCH // dp, global_batch_size=GLOBAL_BATCH, lr=LR, min_lr=MIN_LR,
        lr_decay_style="cosine", lr_warmup_iters=WARMUP, lr_decay_iters=DECAY, train_iters=DECAY,
        weight_decay=WEIGHT_DECAY, start_weight_decay=WEIGHT_DECAY, end_weight_decay=WEIGHT_DECAY,
        weight_decay_incr_style="constant", clip_grad=CLIP, adam_beta1=0.9, adam_beta2=0.999, adam_eps=1e-8,
        optimizer="adam", use_distributed_optimizer=distributed, ckpt_format=fmt, iteration=ITERATION,
        consumed_train_samples=ITERATION * GLOBAL_BATCH, dist_ckpt_optim_fully_reshardable=sharding == "fully_reshardable",
        overlap_grad_reduce=False, ddp_bucket_size=None, no_save_optim=None, no_save_rng=None)


def _step(ddp, optimizer, scheduler, tokens: torch.Tensor, dp_rank: int, dp: int) -> float:
    """One iteration on this DP rank's rows of the global batch; the DP-mean loss."""
    from megatron.core import parallel_state

    rows = tokens[dp_rank * (GLOBAL_BATCH // dp):(dp_rank + 1) * (GLOBAL_BATCH // dp)]
    ids, labels = rows[:, :-1], rows[:, 1:]
    positions = torch.arange(SEQ).expand_as(ids)
    causal = torch.triu(torch.ones(SEQ, SEQ, dtype=torch.bool), diagonal=1)[None, None]
    ddp.zero_grad_buffer()
    optimizer.zero_grad()
    loss = ddp(ids, positions, causal, labels=labels).float().mean()
    loss.backward()
    ddp.finish_grad_sync()
    ok, _, _ = optimizer.step()
    assert ok
    scheduler.step(increment=GLOBAL_BATCH)
    mean = loss.detach().clone()
    dist.all_reduce(mean, group=parallel_state.get_data_parallel_group())
    return mean.item() / dp


def _rng_state() -> list[dict]:
    """get_rng_state's list (one entry: no --data-parallel-random-init); on CPU the torch state
    stands in for the CUDA one and there are no CUDA tracker states."""
    return [{"random_rng_state": random.getstate(), "np_rng_state": np.random.get_state(),
             "torch_rng_state": torch.get_rng_state(), "cuda_rng_state": torch.get_rng_state(),
             "rng_tracker_states": {}}]


def _save_torch(root: Path, args, ddp, optimizer, scheduler, distributed: bool) -> None:
    from megatron.core import parallel_state

    folder = root / f"iter_{ITERATION:07d}" / f"mp_rank_{parallel_state.get_tensor_model_parallel_rank():02d}"
    dp_rank = parallel_state.get_data_parallel_rank()
    if dp_rank == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    if distributed:
        optimizer.save_parameter_state(str(folder / "distrib_optim.pt"))  # gathers on DP rank 0
    if dp_rank == 0:
        state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                 "model": ddp.module.state_dict_for_save_checkpoint(), "optimizer": optimizer.state_dict(),
                 "opt_param_scheduler": scheduler.state_dict(), "rng_state": _rng_state(),
                 "num_floating_point_operations_so_far": 0}
        torch.save(state, folder / "model_optim_rng.pt")
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def _save_torch_dist(root: Path, args, ddp, optimizer, scheduler, sharding: str | None) -> None:
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    folder = root / f"iter_{ITERATION:07d}"
    if dist.get_rank() == 0:
        folder.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    content = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if sharding is not None:
        content.update(distrib_optim_sharding_type=sharding, distrib_optim_fully_reshardable_mem_efficient=False)
    metadata = {**content, "dp_cp_group": parallel_state.get_data_parallel_group(with_context_parallel=True)}
    state = {"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
             "model": ddp.module.sharded_state_dict(metadata=metadata)}
    state["optimizer"] = optimizer.sharded_state_dict(state, metadata=metadata)
    state["opt_param_scheduler"] = scheduler.state_dict()
    state["rng_state"] = ShardedObject(
        "rng_state", _rng_state(), (1, parallel_state.get_tensor_model_parallel_world_size()),
        (0, parallel_state.get_tensor_model_parallel_rank()), replica_id=parallel_state.get_data_parallel_rank())
    state["num_floating_point_operations_so_far"] = 0
    dist_checkpointing.save(state, str(folder), content_metadata=content)
    dist.barrier()
    if dist.get_rank() == 0:
        (root / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))


def train_and_save(rank: int, world: int, out: str, family: str, tp: int, distributed: bool,
                   saves: list[tuple[str, str | None]], bucket_size: int | None = None, bf16: bool = False) -> None:
    """Spawned worker (world = tp x dp): STEPS_SAVED steps, a checkpoint in each (format,
    sharding) of `saves` under out/<format>[_<sharding>], STEPS_AFTER more steps; out/losses.pt.
    `bucket_size`: --overlap-grad-reduce with --ddp-bucket-size (gradient buckets of about that
    many elements; default one bucket). `bf16`: bf16 weights, fp32 main parameters in the optimizer
    (Float16OptimizerWithFloat16Params, or the distributed optimizer's fp32 shards)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    cpu_shims(optimizer=True)
    dp = world // tp
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=1)
    try:
        model = build_model(family, seed=1234, tp=tp, pp=1, bf16=bf16)
        ddp = DistributedDataParallel(model.config, DistributedDataParallelConfig(
            use_distributed_optimizer=distributed, grad_reduce_in_fp32=True, overlap_grad_reduce=bucket_size is not None,
            bucket_size=bucket_size), model)
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=LR, min_lr=MIN_LR, weight_decay=WEIGHT_DECAY, adam_beta1=0.9, adam_beta2=0.999,
            adam_eps=1e-8, clip_grad=CLIP, use_distributed_optimizer=distributed, bf16=bf16), [ddp])
        scheduler = OptimizerParamScheduler(
            optimizer, init_lr=0.0, max_lr=LR, min_lr=MIN_LR, lr_warmup_steps=WARMUP * GLOBAL_BATCH,
            lr_decay_steps=DECAY * GLOBAL_BATCH, lr_decay_style="cosine", start_wd=WEIGHT_DECAY,
            end_wd=WEIGHT_DECAY, wd_incr_steps=DECAY * GLOBAL_BATCH, wd_incr_style="constant")
        dp_rank, steps = parallel_state.get_data_parallel_rank(), batches()
        losses = [_step(ddp, optimizer, scheduler, steps[i], dp_rank, dp) for i in range(STEPS_SAVED)]
        if dp_rank == 0:  # what the saves below store as this TP rank's torch RNG state
            tp_rank = parallel_state.get_tensor_model_parallel_rank()
            torch.save(torch.get_rng_state(), Path(out) / f"torch_rng_tp{tp_rank}.pt")
        for fmt, sharding in saves:
            root = Path(out) / (fmt + (f"_{sharding}" if sharding else ""))
            args = training_args(family, tp, dp, distributed, fmt, sharding)
            args.overlap_grad_reduce, args.ddp_bucket_size = bucket_size is not None, bucket_size
            args.bf16, args.params_dtype = bf16, torch.bfloat16 if bf16 else torch.float32
            if fmt == "torch":
                _save_torch(root, args, ddp, optimizer, scheduler, distributed)
            else:
                _save_torch_dist(root, args, ddp, optimizer, scheduler, sharding)
        losses += [_step(ddp, optimizer, scheduler, steps[i], dp_rank, dp)
                   for i in range(STEPS_SAVED, STEPS_SAVED + STEPS_AFTER)]
        if rank == 0:
            torch.save(torch.tensor(losses, dtype=torch.float64), Path(out) / "losses.pt")
    finally:
        parallel_state.destroy_model_parallel()


def save_bucket_layout_probe(rank: int, world: int, out: str, bucket_size: int) -> None:
    """Spawned worker (4 ranks): the distributed optimizer's bucket layout under every rule at
    once. Tied GPT-2 at TP=1 PP=2 DP=2 with 2 virtual stages (the tied embedding's copies get
    buckets of their own; only pipeline rank 0's first chunk is cut into buckets of about
    `bucket_size` elements), Megatron-Core's DDP and DistributedOptimizer over both chunks, one
    Adam step at learning rate 0 whose gradients are the weights themselves, so that every
    element holds exp_avg = 0.1 w and exp_avg_sq = 0.001 w^2 beside its unchanged weight w;
    saved in the torch format (model0 / model1 and distrib_optim.pt per pipeline rank)."""
    from megatron.core import parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    cpu_shims(optimizer=True)
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                                             virtual_pipeline_model_parallel_size=2)
    try:
        chunks = [build_model("gpt2", seed=1234, tp=1, pp=2, vp=2, vp_stage=c) for c in range(2)]
        ddps = [DistributedDataParallel(chunk.config, DistributedDataParallelConfig(
            use_distributed_optimizer=True, grad_reduce_in_fp32=True, overlap_grad_reduce=True,
            bucket_size=bucket_size), chunk, disable_bucketing=c > 0) for c, chunk in enumerate(chunks)]
        optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=0.0, weight_decay=0.1, clip_grad=0.0, use_distributed_optimizer=True), ddps)
        for ddp in ddps:
            ddp.zero_grad_buffer()
            for param in ddp.module.parameters():
                param.main_grad.copy_(param.detach())
            ddp.start_grad_sync()
            ddp.finish_grad_sync()
        ok, _, _ = optimizer.step()
        assert ok
        pp_rank, dp_rank = parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_data_parallel_rank()
        folder = Path(out) / f"iter_{ITERATION:07d}" / f"mp_rank_00_{pp_rank:03d}"
        if dp_rank == 0:
            folder.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        optimizer.save_parameter_state(str(folder / "distrib_optim.pt"))
        if dp_rank == 0:
            args = megatron_args("gpt2", tensor_model_parallel_size=1, pipeline_model_parallel_size=2,
                                 virtual_pipeline_model_parallel_size=2, data_parallel_size=2, world_size=4,
                                 use_distributed_optimizer=True, optimizer="adam", overlap_grad_reduce=True,
                                 ddp_bucket_size=bucket_size, iteration=ITERATION)
            torch.save({"args": args, "checkpoint_version": 3.0, "iteration": ITERATION,
                        **{f"model{c}": ddp.module.state_dict_for_save_checkpoint() for c, ddp in enumerate(ddps)},
                        "optimizer": optimizer.state_dict()}, folder / "model_optim_rng.pt")
        dist.barrier()
        if rank == 0:
            (Path(out) / "latest_checkpointed_iteration.txt").write_text(str(ITERATION))
    finally:
        parallel_state.destroy_model_parallel()
