"""Tensor-parallel linear and embedding layers (Megatron-LM, Shoeybi et al. 2019).

Each layer initialises the full (TP=1) weight from a generator and keeps this rank's slice, so
the shards at any TP size are exact slices of the TP=1 initialisation for the same seed; only one
full tensor is alive at a time. With `on_shard` a layer draws its shard directly instead (no
full tensor at all, for weights too large to hold whole): the caller then seeds the generator
per TP rank, and the shards are no longer slices of the TP=1 initialisation.
"""


import torch
import torch.nn.functional as F
from torch import nn

from megalite.parallel import comm
from megalite.parallel.tensor.deferred_wgrad import linear_with_deferred_wgrad
from megalite.parallel.tensor.gemm import DEFAULT_GEMM
from megalite.parallel.tensor.linear_function import tensor_parallel_linear
from megalite.parallel.tensor.overlapped_linear import column_parallel_overlapped, row_parallel_overlapped
from megalite.parallel.sharding import mark_sequence_parallel, mark_sharded, shard_of_full


def _normal_full(shape, std, generator, device, rows=None) -> torch.Tensor:
    """N(0, std) full tensor; with `rows`, only the first `rows` rows are drawn and the rest
    (vocabulary padding, whose size depends on the TP size) are zero, so the real rows are the
    same at every TP size."""
    rows = shape[0] if rows is None else rows
    full = torch.zeros(shape, dtype=torch.float32, device=device)
    full[:rows].normal_(0.0, std, generator=generator)
    return full


def _init_sharded_(param: nn.Parameter, full: torch.Tensor, group) -> None:
    shard = shard_of_full(full, param.partition_dim, param.partition_stride,
                          comm.group_rank(group), comm.group_size(group))
    with torch.no_grad():
        param.copy_(shard)


def _init_normal_(param: nn.Parameter, full_shape, std, generator, group, rows=None, on_shard=False) -> None:
    """N(0, std) into `param`: this rank's slice of a full draw, or with `on_shard` a draw of
    the shard alone. `rows` (first `rows` rows real, the rest zero) needs partition_dim 0."""
    if not on_shard:
        _init_sharded_(param, _normal_full(full_shape, std, generator, param.device, rows), group)
        return
    local_rows = param.shape[0]
    first_row = comm.group_rank(group) * local_rows if param.partition_dim == 0 else 0
    real = local_rows if rows is None else min(max(rows - first_row, 0), local_rows)
    shard = torch.zeros(param.shape, dtype=torch.float32, device=param.device)
    shard[:real].normal_(0.0, std, generator=generator)
    with torch.no_grad():
        param.copy_(shard)


class ColumnParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its output dimension: rank i computes Y_i = X A_i^T + b_i.

    Input X is replicated over the TP group (or, with sequence parallelism, split along the
    sequence and all-gathered here; backward gathers it again, see linear_function.py). With
    `gather_output` the output is all-gathered along its last dimension; otherwise each rank
    keeps its slice. `stride` > 1 splits each of `stride` equal output blocks separately (a
    fused [gate; up] projection).

    Set after construction: `comm_overlap` (a comm_overlap.LinearOverlap, --tp-comm-overlap)
    splits the sequence-parallel all-gather to overlap it with the GEMM; `wgrad_deferral`
    (deferred_wgrad.defer_wgrad, --defer-embedding-wgrad-compute) defers the weight gradient;
    `gemm` (gemm.py) is the strategy its GEMMs go through.
    """

    def __init__(self, input_size, output_size, *, tp_group=None, bias=True, gather_output=False,
                 sequence_parallel=False, stride=1, init_std=0.02, skip_bias_add=False,
                 skip_weight=False, init_rows=None, params_dtype=torch.float32, device=None):
        super().__init__()
        tp = comm.group_size(tp_group)
        if output_size % (tp * stride):
            raise ValueError(f"ColumnParallelLinear: output size {output_size} is not divisible by "
                             f"TP size {tp} x stride {stride}")
        if gather_output and sequence_parallel:
            raise ValueError("ColumnParallelLinear: gather_output is not supported with sequence_parallel")
        self.input_size, self.output_size = input_size, output_size
        self.tp_group, self.gather_output = tp_group, gather_output
        self.sequence_parallel, self.skip_bias_add = sequence_parallel, skip_bias_add
        self.init_std, self.init_rows = init_std, init_rows
        local = output_size // tp
        # skip_weight: the weight is passed to forward (an output layer tied to the embedding)
        self.weight = None if skip_weight else mark_sharded(
            nn.Parameter(torch.empty(local, input_size, dtype=params_dtype, device=device)), 0, stride)
        self.stride = stride
        self.bias = (mark_sharded(nn.Parameter(torch.empty(local, dtype=params_dtype, device=device)), 0, stride)
                     if bias else None)
        self.comm_overlap = self.wgrad_deferral = None
        self.gemm = DEFAULT_GEMM

    def reset_parameters(self, generator: torch.Generator, on_shard: bool = False) -> None:
        if self.weight is not None:
            _init_normal_(self.weight, (self.output_size, self.input_size), self.init_std, generator,
                          self.tp_group, self.init_rows, on_shard)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x, weight=None):
        """`weight` overrides the layer's own (the output layer tied to the input embedding)."""
        bias = None if self.skip_bias_add else self.bias
        weight = self.weight if weight is None else weight
        deferral = self.wgrad_deferral
        if deferral is not None and torch.is_grad_enabled() and weight.requires_grad and deferral.takes_another():
            y = linear_with_deferred_wgrad(x, weight, bias, deferral)
        elif self.sequence_parallel and self.comm_overlap is not None and comm.group_size(self.tp_group) > 1:
            y = column_parallel_overlapped(x, weight, bias, self.tp_group, self.comm_overlap)
        elif self.sequence_parallel:  # saves the input's sequence shard, not the gathered input
            y = tensor_parallel_linear(x, weight, bias, self.gemm, self.tp_group, gather_input=True)
        else:
            y = tensor_parallel_linear(comm.copy_to_tensor_parallel_region(x, self.tp_group), weight, bias, self.gemm)
        if self.gather_output:
            y = comm.gather_from_tensor_parallel_region(y, self.tp_group)
        return (y, self.bias) if self.skip_bias_add else y


class RowParallelLinear(nn.Module):
    """Y = X A^T + b with A split along its input dimension: rank i computes X_i A_i^T and the
    partial results are all-reduced (or, with sequence parallelism, reduce-scattered along the
    sequence). The bias is replicated and added after the reduction. `comm_overlap` (set after
    construction, --tp-comm-overlap) overlaps that reduce-scatter with the GEMM; `gemm` as the
    column-parallel layer's."""

    def __init__(self, input_size, output_size, *, tp_group=None, bias=True, input_is_parallel=True,
                 sequence_parallel=False, init_std=0.02, skip_bias_add=False,
                 params_dtype=torch.float32, device=None):
        super().__init__()
        tp = comm.group_size(tp_group)
        if input_size % tp:
            raise ValueError(f"RowParallelLinear: input size {input_size} is not divisible by TP size {tp}")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel needs input_is_parallel")
        self.input_size, self.output_size = input_size, output_size
        self.tp_group, self.input_is_parallel = tp_group, input_is_parallel
        self.sequence_parallel, self.skip_bias_add = sequence_parallel, skip_bias_add
        self.init_std = init_std
        self.weight = mark_sharded(nn.Parameter(torch.empty(output_size, input_size // tp, dtype=params_dtype, device=device)), 1)
        self.bias = None
        if bias:
            self.bias = mark_sequence_parallel(
                nn.Parameter(torch.empty(output_size, dtype=params_dtype, device=device)), sequence_parallel)
        self.comm_overlap = None
        self.gemm = DEFAULT_GEMM

    def reset_parameters(self, generator: torch.Generator, on_shard: bool = False) -> None:
        _init_normal_(self.weight, (self.output_size, self.input_size), self.init_std, generator,
                      self.tp_group, None, on_shard)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x):
        if not self.input_is_parallel:
            x = comm.scatter_to_tensor_parallel_region(x, self.tp_group)
        if self.sequence_parallel and self.comm_overlap is not None and comm.group_size(self.tp_group) > 1:
            y = row_parallel_overlapped(x, self.weight, self.tp_group, self.comm_overlap)
        elif self.sequence_parallel:
            y = comm.reduce_scatter_to_sequence_parallel_region(tensor_parallel_linear(x, self.weight, None, self.gemm),
                                                                self.tp_group)
        else:
            y = comm.reduce_from_tensor_parallel_region(tensor_parallel_linear(x, self.weight, None, self.gemm),
                                                        self.tp_group)
        if self.skip_bias_add:
            return y, self.bias
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary: rank i holds rows [i*V/t, (i+1)*V/t).

    Each rank looks up the ids it owns (zeros elsewhere) and the partial results are summed
    over the group: all-reduced, or with `sequence_parallel` reduce-scattered along dim 0 (pass
    ids as [seq, batch] then)."""

    def __init__(self, num_embeddings, embedding_dim, *, tp_group=None, sequence_parallel=False,
                 init_std=0.02, init_rows=None, params_dtype=torch.float32, device=None):
        super().__init__()
        tp = comm.group_size(tp_group)
        if num_embeddings % tp:
            raise ValueError(f"VocabParallelEmbedding: vocabulary {num_embeddings} is not divisible by TP size {tp}")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.init_std, self.init_rows = init_std, init_rows
        self.per_rank = num_embeddings // tp
        self.vocab_start = comm.group_rank(tp_group) * self.per_rank
        self.weight = mark_sharded(nn.Parameter(torch.empty(self.per_rank, embedding_dim, dtype=params_dtype, device=device)), 0)

    def reset_parameters(self, generator: torch.Generator, on_shard: bool = False) -> None:
        _init_normal_(self.weight, (self.num_embeddings, self.embedding_dim), self.init_std, generator,
                      self.tp_group, self.init_rows, on_shard)

    def forward(self, ids):
        if comm.group_size(self.tp_group) == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return comm.reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return comm.reduce_from_tensor_parallel_region(out, self.tp_group)

