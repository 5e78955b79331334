"""Data parallelism for one model chunk: gradients accumulate into bucketed main-gradient
buffers (grad_buffer.py) and are reduced bucket by bucket over DP x CP (Megatron's
data_parallel_group(with_context_parallel=True)): summed over the context-parallel ranks,
averaged over the data-parallel ones. The distributed optimizer shards over the same group.

Per training step the loop (or the pipeline executor) does, for every chunk:

    optimizer.zero_grad()                      # zeros the buffers
    with chunk.no_sync():                      # all micro-batches but the last
        ...forward / backward...
    ...forward / backward of the last micro-batch...
    finalize_model_grads(chunks, pstate)       # DP sync, then TP and embedding all-reduces
    optimizer.step()

With overlap_grad_reduce a bucket's collective starts from the backward hook of the last
parameter to become ready in the last micro-batch, so communication overlaps the rest of the
backward; without it finish_grad_sync does all communication.

With several distributed-optimizer instances (pstate.optimizer_instances > 1, distributed
optimizer only) buckets shard over the instance's part of DP x CP and sum their shard across
instances (grad_buffer.py). A layer whose weight gradient is deferred to the end of the step
(--defer-embedding-wgrad-compute, megalite.parallel.tensor.deferred_wgrad) computes it in
finish_grad_sync, before its bucket is reduced; that weight never marks its bucket ready early.

With gradient_accumulation_fusion (Megatron's default; --no-gradient-accumulation-fusion) every
parameter is marked `fuse_wgrad_accumulation`: the tensor-parallel linears then add their
weight gradients to main_grad inside the weight-gradient GEMM and hand autograd None
(megalite.parallel.tensor.gemm), so the post-accumulate hook finds no .grad to add and only
marks the parameter ready. Parameters no fused GEMM serves (norms, embeddings, biases,
expert weights) still arrive as .grad and are added here; a weight used twice (the tied
embedding) gets both: its fused share in main_grad, the other in .grad.
"""

import contextlib

import torch
from torch import nn

from megalite.parallel import comm
from megalite.parallel.data.grad_buffer import GradBuffer
from megalite.parallel.state import ParallelState
from megalite.parallel.tensor.deferred_wgrad import deferrals_in, is_wgrad_deferred


def default_bucket_size(dp_size: int) -> int:
    """Megatron's default: large buckets, growing with the data-parallel size."""
    return max(40_000_000, 1_000_000 * dp_size)


class DistributedDataParallel(nn.Module):
    """Wrap ONE model chunk for data-parallel training.

    Args:
        module: the model chunk.
        pstate: parallel state (its dp_cp_group is used: DP x CP, or DP without CP).
        bucket_size: elements per gradient bucket (--ddp-bucket-size); None picks Megatron's
            default with overlap and a single bucket per dtype without.
        overlap_grad_reduce: start each bucket's collective as soon as its gradients are ready.
        use_distributed_optimizer: reduce-scatter gradients into per-rank shards and keep the
            parameters in a flat buffer the optimizer all-gathers into.
        grad_dtype: dtype of the main gradients.
        disable_bucketing: one bucket per buffer whatever bucket_size says (Megatron's
            disable_bucketing, which --overlap-param-gather-with-optimizer-step sets).
        gradient_accumulation_fusion: let the linears accumulate weight gradients into
            main_grad inside their GEMM (see the module).
    """

    def __init__(self, module: nn.Module, pstate: ParallelState, *, bucket_size: int | None = None,
                 overlap_grad_reduce: bool = False, use_distributed_optimizer: bool = False,
                 grad_dtype: torch.dtype = torch.float32, disable_bucketing: bool = False,
                 gradient_accumulation_fusion: bool = False):
        super().__init__()
        if bucket_size is not None and bucket_size < 1:
            raise ValueError(f"--ddp-bucket-size must be positive, got {bucket_size}")
        if pstate.optimizer_instances > 1 and not use_distributed_optimizer:
            raise ValueError(f"--num-distributed-optimizer-instances {pstate.optimizer_instances} needs "
                             "--use-distributed-optimizer (the instances are its shards)")
        self.module, self.pstate = module, pstate
        self.overlap_grad_reduce = overlap_grad_reduce
        self.use_distributed_optimizer = use_distributed_optimizer
        self.dp_group = pstate.dp_cp_group
        if bucket_size is None and overlap_grad_reduce:
            bucket_size = default_bucket_size(pstate.dp_size * pstate.cp_size)
        self.bucket_size = bucket_size = None if disable_bucketing else bucket_size
        self._sync_enabled = True

        # Expert parameters (param.expert_parallel) sit in their own buffers, averaged over the
        # expert-data-parallel group: each rank's experts already summed its ETP x EP block's tokens.
        expert = pstate.expert
        by_kind: dict = {}
        for param in module.parameters():
            if param.requires_grad:
                by_kind.setdefault((param.dtype, getattr(param, "expert_parallel", False)), []).append(param)

        def reduction(is_expert):
            # the distributed optimizer shards within its instance; instances sum their shards
            if is_expert and expert is not None:
                if use_distributed_optimizer:
                    return {"dp_group": expert.edp_instance_group, "replica_group": expert.edp_replica_group,
                            "grad_scale": expert.grad_scale}
                return {"dp_group": expert.edp_group, "grad_scale": expert.grad_scale}
            # each CP rank's gradient is that of its part of every sequence: summed over CP
            if use_distributed_optimizer:
                return {"dp_group": pstate.dp_cp_instance_group, "replica_group": pstate.dp_cp_replica_group,
                        "grad_scale": float(pstate.cp_size)}
            return {"dp_group": self.dp_group, "grad_scale": float(pstate.cp_size)}

        def own_bucket(param):
            # A tied embedding copy must be laid out identically on the first and last stage so
            # that its embedding-group all-reduce adds matching shards.
            return use_distributed_optimizer and getattr(param, "shared_embedding", False)

        self.buffers_ = [GradBuffer(params, grad_dtype=grad_dtype, bucket_size=bucket_size,
                                    sharded=use_distributed_optimizer, own_bucket=own_bucket, **reduction(is_expert))
                         for (_, is_expert), params in by_kind.items()]
        self._bucket_of = {p: b for buffer in self.buffers_ for p, b in buffer.bucket_of.items()}
        self.gradient_accumulation_fusion = gradient_accumulation_fusion
        for param in self._bucket_of:
            param.fuse_wgrad_accumulation = gradient_accumulation_fusion
            param.grad_added_to_main_grad = False  # set by a fused GEMM, reset with the buffers
        self._hooks = [p.register_post_accumulate_grad_hook(self._grad_ready) for p in self._bucket_of]
        self._param_gather_hooks = []

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @property
    def buckets(self):
        return [bucket for buffer in self.buffers_ for bucket in buffer.buckets]

    def _grad_ready(self, param) -> None:
        if param.grad is not None:  # None: a deferred or fused weight gradient's backward (see the module)
            param.main_grad.add_(param.grad)
            param.grad = None
        # a deferred weight gradient is complete only after finish_grad_sync drains it
        if self.overlap_grad_reduce and self._sync_enabled and not is_wgrad_deferred(param):
            bucket = self._bucket_of[param]
            if bucket.mark_ready(param):
                bucket.start_grad_sync(async_op=True)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients without communicating (all micro-batches but the last)."""
        previous, self._sync_enabled = self._sync_enabled, False
        try:
            yield
        finally:
            self._sync_enabled = previous

    def start_grad_sync(self) -> None:
        """Launch the collective of every bucket not yet launched (asynchronously)."""
        for bucket in self.buckets:
            bucket.start_grad_sync(async_op=True)

    def finish_grad_sync(self) -> None:
        """Complete the data-parallel averaging of every bucket; afterwards main_grad (or, with
        the distributed optimizer, this rank's shard of it) holds the averaged gradient."""
        self.finish_param_sync()
        for deferral in deferrals_in(self.module):
            deferral.drain()
        for bucket in self.buckets:
            bucket.finish_grad_sync()
            bucket.reset()

    def zero_grad_buffer(self) -> None:
        for buffer in self.buffers_:
            buffer.zero()
        for param in self._bucket_of:
            param.grad = None
            param.grad_added_to_main_grad = False

    def start_param_sync(self, overlap: bool = False) -> None:
        """All-gather the updated parameter shards (distributed optimizer). With `overlap`, the
        gathers run asynchronously and each module waits for its buckets in a forward pre-hook."""
        if overlap and not self._param_gather_hooks:
            self._register_param_gather_hooks()
        # Launched in forward order: the last bucket holds the first layers.
        for bucket in reversed(self.buckets):
            bucket.start_param_sync(async_op=overlap)

    def finish_param_sync(self) -> None:
        for bucket in self.buckets:
            bucket.finish_param_sync()

    def remove_grad_hooks(self) -> None:
        """For the end of a run. Each gradient hook is held by its parameter's autograd metadata,
        in C++, where the garbage collector cannot see it: without this, the cycle parameter ->
        hook -> this DDP -> module -> parameter, and every process group it holds, lives until
        the interpreter's finalization, when a gloo worker thread that still needs the GIL
        aborts the process ("terminate called without an active exception")."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _register_param_gather_hooks(self) -> None:
        for module in self.module.modules():
            buckets = {self._bucket_of[p] for p in module.parameters(recurse=False) if p in self._bucket_of}
            if buckets:
                self._param_gather_hooks.append(module.register_forward_pre_hook(
                    _wait_for_buckets(sorted(buckets, key=lambda b: -b.index))))


def _wait_for_buckets(buckets):
    def hook(_module, _args):
        for bucket in buckets:
            bucket.finish_param_sync()
    return hook


def main_grad_of(param: torch.Tensor) -> torch.Tensor | None:
    """The gradient the optimizer will read: main_grad under our DDP, the local shard of
    .grad under FSDP2, else .grad."""
    grad = getattr(param, "main_grad", None)
    if grad is None:
        grad = param.grad
        if grad is not None and hasattr(grad, "to_local"):
            grad = grad.to_local()
    return grad


def _all_reduce_coalesced(grads: list[torch.Tensor], group) -> None:
    if comm.group_size(group) == 1 or not grads:
        return
    for dtype in {g.dtype for g in grads}:
        same = [g for g in grads if g.dtype == dtype]
        flat = torch._utils._flatten_dense_tensors(same)
        comm.all_reduce(flat, group)
        for grad, synced in zip(same, torch._utils._unflatten_dense_tensors(flat, same)):
            grad.copy_(synced)


def finalize_model_grads(chunks, pstate: ParallelState) -> None:
    """Finish every chunk's data-parallel gradient sync, then sum over the TP group the
    gradients of sequence-parallel replicated parameters and over the embedding group those of
    the tied embedding copies. Call once per step after the last backward."""
    for chunk in chunks:
        chunk.finish_grad_sync()
    params = [p for chunk in chunks for p in chunk.module.parameters() if p.requires_grad]
    sequence_parallel = [main_grad_of(p) for p in params if getattr(p, "sequence_parallel", False)]
    _all_reduce_coalesced([g for g in sequence_parallel if g is not None], pstate.tp_group)
    shared = [main_grad_of(p) for p in params if getattr(p, "shared_embedding", False)]
    _all_reduce_coalesced([g for g in shared if g is not None], pstate.embedding_group)
