"""fp32 main parameters over (shards of) gradient buckets, for the optimizer in mixed_precision.py.

Every bucket of a DistributedDataParallel chunk has a shard this rank updates: the whole bucket
normally, the contiguous 1/d slice [r·n/d, (r+1)·n/d) under the distributed optimizer (ZeRO-1:
main parameters and optimizer state sharded over the d ranks of the bucket's data-parallel
group, which is DP x CP for dense parameters and the expert-data-parallel group for experts;
with several distributed-optimizer instances, that group's part in this rank's instance, the
other instances holding replicas of the same shards). For each model
parameter overlapping that shard there is one `MainParam`: an fp32 1-D tensor holding elements
[lo, hi) of the flattened parameter, whose `.grad` views the reduced gradient.

Storage is shared wherever possible: an fp32 parameter's main tensor IS (a view of) the
parameter, and an fp32 main gradient IS (a view of) the DDP buffer. Copies exist only for 16-bit
parameters or gradients and for --optimizer-cpu-offload (where they live on the CPU).

Checkpoints do not gather: each rank hands over its own elements as a `FlatShard`, which says
where every sharding-group rank's elements lie (`bucket_dp_ranges`, `dtensor_dp_ranges`), and
DCP writes the shards. Only the tests' layout-independent oracle, the optimizer's gathered
state dict, gathers each parameter's shards over that group (`gather_full`,
`sharded_dp_group`), so it is the same with the distributed optimizer on or off.
"""

from dataclasses import dataclass

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.data.grad_buffer import Bucket
from megalite.parallel.expert.groups import reduction_index
from megalite.parallel.sharding import is_sharded


@dataclass
class MainParam:
    """The optimizer's fp32 copy of elements [lo, hi) of a flattened model parameter."""

    name: str
    param: torch.nn.Parameter
    main: torch.Tensor
    lo: int
    hi: int
    counted: bool
    """Whether this rank counts it in the global gradient norm (once per parameter, not once
    per TP replica or per tied embedding copy)."""

    def grad(self) -> torch.Tensor | None:
        grad = self.main.grad
        return grad.to_local() if grad is not None and hasattr(grad, "to_local") else grad


@dataclass
class FlatShard:
    """Elements [lo, hi) of a flattened tensor of shape `shape` (a TP-local parameter, or an
    optimizer state of it) that this rank holds, as a 1-D tensor `values`."""

    values: torch.Tensor
    lo: int
    hi: int
    shape: torch.Size
    dp_ranges: list | None = None
    """Every (lo, hi) in group-rank order when the tensor is sharded over a data-parallel group
    (DP x CP, or the expert-data-parallel group; the ranges partition [0, numel)); None when
    every rank of it holds all of it."""


@dataclass
class BucketShard:
    """This rank's shard of one bucket and the fp32 copies it needs."""

    bucket: Bucket
    mains: list
    main_flat: torch.Tensor | None  # fp32 parameter copy (None: the mains view the parameters)
    grad_flat: torch.Tensor | None  # fp32 gradient copy (None: the mains' grads view the buffer)

    def load_grads(self) -> None:
        if self.grad_flat is not None:
            self.grad_flat.copy_(self.bucket.grad_shard())

    @torch.no_grad()
    def store_params(self) -> None:
        """Copy updated main values into the model parameters (this rank's shard)."""
        if self.main_flat is None:
            return
        if self.bucket.param_data is not None:
            self.bucket.param_shard().copy_(self.main_flat)
        else:
            for m in self.mains:
                m.param.detach().view(-1)[m.lo:m.hi].copy_(m.main)


def counts_in_norm(param, tp_rank: int, chunk_module) -> bool:
    """Replicated-over-TP parameters count on TP rank 0 only; a tied embedding copy on a
    stage without the embedding does not count (the first stage's copy does)."""
    if not is_sharded(param) and tp_rank != 0:
        return False
    return not (getattr(param, "shared_embedding", False) and not getattr(chunk_module, "pre_process", True))


def expert_parallel(pstate) -> bool:
    """Whether expert weights are laid out or reduced unlike dense ones (EP > 1, ETP != TP, or
    their expert-data-parallel group spanning CP): the gradient norm then sums over all ranks,
    each replica counted once."""
    return pstate.expert is not None and pstate.expert.layout.differs_from_dense


def norm_group(pstate, sharded_over_dp: bool):
    """The ranks whose counted elements hold each gradient once: every rank of one
    distributed-optimizer instance (every rank, with one instance) when the state is sharded
    (over DP x CP) or experts are laid out unlike dense weights, else one model replica. Megatron
    reduces gradient statistics over the same intra-instance group (optimizer/__init__.py,
    grad_stats_parallel_group)."""
    if sharded_over_dp or expert_parallel(pstate):
        return pstate.instance_group
    return pstate.mp_group


def fsdp_main_params(fsdp_chunk, tp_rank: int) -> list[MainParam]:
    """An FSDPChunk's main parameters: its sharded fp32 parameters themselves."""
    return [MainParam(name, p, p, 0, p.numel(), counts_in_norm(p, tp_rank, fsdp_chunk.module))
            for name, p in fsdp_chunk.module.named_parameters() if p.requires_grad]


@torch.no_grad()
def build_bucket_shards(ddp_chunk, tp_rank: int, cpu_offload: bool) -> list[BucketShard]:
    """MainParams for every bucket shard of one DistributedDataParallel chunk."""
    names = {p: n for n, p in ddp_chunk.module.named_parameters()}
    shards = []
    for buffer in ddp_chunk.buffers_:
        device = torch.device("cpu") if cpu_offload else buffer.device
        copy_params = buffer.param_dtype != torch.float32 or cpu_offload
        copy_grads = buffer.grad_dtype != torch.float32 or cpu_offload
        for bucket in buffer.buckets:
            s0, s1 = bucket.shard_start, bucket.shard_end
            main_flat = torch.zeros(s1 - s0, dtype=torch.float32, device=device) if copy_params else None
            grad_flat = torch.zeros(s1 - s0, dtype=torch.float32, device=device) if copy_grads else None
            mains = []
            for param, (start, end) in bucket.param_ranges.items():
                a, b = max(start, s0), min(end, s1)
                if a >= b:
                    continue
                lo, hi = a - start, b - start
                flat = param.detach().view(-1)[lo:hi]
                main = flat if main_flat is None else main_flat[a - s0:b - s0]
                if main_flat is not None:
                    main.copy_(flat)
                main.grad = bucket.grad_data[a:b] if grad_flat is None else grad_flat[a - s0:b - s0]
                counted = counts_in_norm(param, tp_rank, ddp_chunk.module)
                if expert_parallel(ddp_chunk.pstate):  # one replica: rank 0 of each group replicating it
                    counted = counted and comm.group_rank(getattr(bucket, "cp_group", None)) == 0 and \
                        (bucket.sharded_over_dp or comm.group_rank(bucket.dp_group) == 0)
                mains.append(MainParam(names[param], param, main, lo, hi, counted))
            shards.append(BucketShard(bucket, mains, main_flat, grad_flat))
    return shards


@torch.no_grad()
def gather_full(param: torch.nn.Parameter, entry: MainParam | None, value: torch.Tensor | None,
                dp_group) -> torch.Tensor:
    """`value` (this rank's [lo, hi) piece of a per-element quantity of `param`, or None if this
    rank owns none of it) as a full fp32 CPU tensor of the parameter's shape. A collective over
    `dp_group` (its bucket's) when the parameter is sharded (pieces are summed into zeros: exact). For the
    gathered state dict, the tests' oracle (checkpoints save FlatShards)."""
    if dp_group is None:
        return value.detach().to("cpu", torch.float32, copy=True).view(param.shape)
    full = torch.zeros(param.numel(), dtype=torch.float32, device=param.device)
    if entry is not None:
        full[entry.lo:entry.hi] = value.detach()
    dist.all_reduce(full, group=dp_group)
    return full.cpu().view(param.shape)


def _sharded_bucket(ddp_chunk, param):
    """`param`'s bucket if it is sharded over its group (see Bucket.sharded_over_dp), else None."""
    bucket = ddp_chunk._bucket_of.get(param)
    return bucket if bucket is not None and bucket.sharded_over_dp else None


def sharded_dp_group(ddp_chunk, param):
    """The group over which `param`'s main value is sharded, or None (for gather_full)."""
    bucket = _sharded_bucket(ddp_chunk, param)
    return bucket.dp_group if bucket is not None else None


def bucket_dp_ranges(ddp_chunk, param) -> list[tuple[int, int]] | None:
    """Each bucket-group rank's (lo, hi) of flattened `param` under the distributed optimizer
    (the part of its bucket range inside that rank's bucket shard; (0, 0) for none), or None
    when the parameter is not sharded. Matches the MainParams of build_bucket_shards."""
    bucket = _sharded_bucket(ddp_chunk, param)
    if bucket is None:
        return None
    start, end = bucket.param_ranges[param]
    ranges = []
    for d in range(bucket.dp_size):
        a, b = max(start, d * bucket.shard_size), min(end, (d + 1) * bucket.shard_size)
        ranges.append((a - start, b - start) if a < b else (0, 0))
    return ranges


def dtensor_dp_ranges(dtensor) -> list[tuple[int, int]] | None:
    """Each mesh rank's (lo, hi) of a DTensor sharded along dim 0 over a 1-D mesh (FSDP2's
    layout over DP x CP: torch.chunk's rows, ceil(rows / d) per rank), or None on a mesh of
    one rank."""
    from torch.distributed.tensor import Shard

    mesh = dtensor.device_mesh
    if mesh.ndim != 1 or list(dtensor.placements) != [Shard(0)]:
        raise ValueError(f"expected a DTensor sharded along dim 0 over one mesh dimension, got "
                         f"{list(dtensor.placements)} over a {mesh.ndim}-D mesh")
    world = mesh.size()
    if world == 1:
        return None
    rows = dtensor.shape[0]
    per_rank, row_numel = -(-rows // world), dtensor.numel() // max(rows, 1)
    ranges = [(min(d * per_rank, rows) * row_numel, min((d + 1) * per_rank, rows) * row_numel) for d in range(world)]
    lo, hi = ranges[mesh.get_local_rank()]
    if dtensor.to_local().numel() != hi - lo:
        raise ValueError(f"FSDP2 shard of {dtensor.to_local().numel()} elements, expected {hi - lo} (rows {rows}, "
                         f"{world} ranks)")
    return ranges


def rank_layout(ranges: list | None, pstate, param, numel: int) -> tuple[int, int, list | None]:
    """(lo, hi, ranges): the elements this rank holds of flattened `param` (or a tensor laid out
    like it) of `numel` elements laid out by `ranges` over its reduction group (DP x CP, for
    expert weights the EDP group; from bucket_dp_ranges or dtensor_dp_ranges; None: every rank
    of it holds all of it)."""
    if ranges is None:
        return 0, numel, None
    return (*ranges[reduction_index(pstate, param)], ranges)
