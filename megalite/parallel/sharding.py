"""How a tensor-parallel parameter relates to its full (TP=1) tensor.

A sharded parameter carries three attributes, set by `mark_sharded`:
    tensor_model_parallel = True
    partition_dim         the dimension split over the TP group
    partition_stride      number of equal blocks along that dimension, each split separately
                          (2 for the fused [gate; up] SwiGLU projection: shard r holds
                          [gate_r; up_r], not a contiguous slice of [gate; up])
A parameter replicated over TP whose gradient is partial per rank under sequence parallelism
(norm weights, row-parallel biases, position embeddings) carries `sequence_parallel = True`.
"""

import torch
import torch.distributed as dist

from megalite.parallel import comm


def mark_sharded(param: torch.nn.Parameter, partition_dim: int, stride: int = 1) -> torch.nn.Parameter:
    param.tensor_model_parallel = True
    param.partition_dim = partition_dim
    param.partition_stride = stride
    return param


def mark_sequence_parallel(param: torch.nn.Parameter, enabled: bool) -> torch.nn.Parameter:
    param.sequence_parallel = enabled
    return param


def is_sharded(param: torch.Tensor) -> bool:
    return getattr(param, "tensor_model_parallel", False)


def _blocks(full: torch.Tensor, partition_dim: int, stride) -> tuple:
    """`stride` equal blocks along partition_dim, or blocks of the sizes a tuple `stride` gives
    (a fused projection of unequal parts each split over the ranks: Gated DeltaNet's in_proj)."""
    if isinstance(stride, tuple):
        return full.split(stride, dim=partition_dim)
    return full.chunk(stride, dim=partition_dim)


def shard_of_full(full: torch.Tensor, partition_dim: int, stride, rank: int, world: int) -> torch.Tensor:
    """This rank's shard of a full tensor (a contiguous copy)."""
    if world == 1:
        return full
    if isinstance(stride, tuple):
        if sum(stride) != full.shape[partition_dim] or any(size % world for size in stride):
            raise ValueError(f"cannot shard dim {partition_dim} of size {full.shape[partition_dim]} into blocks "
                             f"{stride} each split over {world} ranks")
    elif full.shape[partition_dim] % (stride * world):
        raise ValueError(
            f"cannot shard dim {partition_dim} of size {full.shape[partition_dim]} into "
            f"{stride} block(s) x {world} ranks"
        )
    blocks = _blocks(full, partition_dim, stride)
    return torch.cat([b.chunk(world, dim=partition_dim)[rank] for b in blocks], dim=partition_dim).contiguous()


def full_from_shards(shards: list[torch.Tensor], partition_dim: int, stride) -> torch.Tensor:
    """Inverse of `shard_of_full`: reassemble the full tensor from every rank's shard."""
    if len(shards) == 1:
        return shards[0]
    local = tuple(size // len(shards) for size in stride) if isinstance(stride, tuple) else stride
    per_rank = [_blocks(s, partition_dim, local) for s in shards]
    return torch.cat([per_rank[r][b] for b in range(len(per_rank[0])) for r in range(len(shards))], dim=partition_dim)


def gather_tp_full(param: torch.Tensor, value: torch.Tensor, tp_group) -> torch.Tensor:
    """`value` (this rank's shard of `param`, or a tensor laid out like it) as the full tensor,
    all-gathered over `tp_group` when `param` is sharded (a collective every TP rank enters);
    always a new tensor."""
    world = comm.group_size(tp_group)
    if not is_sharded(param) or world == 1:
        return value.detach().clone()
    shards = [torch.empty_like(value) for _ in range(world)]
    dist.all_gather(shards, value.contiguous(), group=tp_group)
    return full_from_shards(shards, param.partition_dim, param.partition_stride)


def param_shard_of_full(param: torch.Tensor, full: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    """The slice of `full` that `param` holds on TP rank `rank` of `world`."""
    if not is_sharded(param):
        return full
    return shard_of_full(full, param.partition_dim, param.partition_stride, rank, world)


def all_reduce_sequence_parallel_grads(params, tp_group) -> None:
    """Sum over the TP group the gradients of replicated parameters that each rank only saw
    part of the sequence for (sequence parallelism)."""
    if comm.group_size(tp_group) == 1:
        return
    for p in params:
        if getattr(p, "sequence_parallel", False) and p.grad is not None:
            comm.all_reduce(p.grad, tp_group)
