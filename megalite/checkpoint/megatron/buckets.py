"""Where Megatron's distributed optimizer keeps each parameter of a model chunk in its flat
buffers, as Megatron-Core lays them out (_ParamAndGradBuffer, and DistributedOptimizer.
_compute_per_buffer_param_layout in later versions; the same rules):

  - a chunk's trainable parameters of one dtype share one buffer, in reverse order of
    named_parameters();
  - each parameter starts at a multiple of 64 elements;
  - the buffer is cut into buckets of at least `bucket_size` elements (no cut when
    --overlap-grad-reduce is off, on pipeline ranks > 0 and in virtual chunks > 0), and the
    tied embedding's copy on a pipeline run's first or last stage (`shared_embedding`) gets a
    bucket of its own;
  - a bucket ends padded to a multiple of lcm(DP, 128) (and of 2^16 with
    --ddp-pad-buckets-for-high-nccl-busbw), DP being the group the optimizer shards over.

The legacy `torch` format's distrib_optim.pt (DistributedOptimizer.save_parameter_state) holds,
per buffer, every bucket's elements up to its last parameter's end, bucket after bucket: the
"world" tensors whose length is `numel_unpadded`. The `torch_dist` 'dp_reshardable' layout holds
the same elements one tensor per bucket (optimizer.distributed.dp_group_idx_<TP x PP rank>.
gbuf_idx_<buffer>.dtype_<(param, grad) dtypes>.bucket_idx_<bucket>.<state>).
"""

import math


def _pad(number: int, divisor: int) -> int:
    return -(-number // divisor) * divisor


def bucket_positions(params: list[tuple[str, int]], dp_size: int, bucket_size: int | None,
                     shared: frozenset = frozenset(), pad_for_busbw: bool = False) -> tuple[dict, list[int]]:
    """For `params` [(name, numel)] in named_parameters order: each name's (bucket, start, end)
    within its bucket, and each bucket's length up to its last parameter's end (Megatron's
    numel_unpadded). Positions within a bucket do not depend on the DP size: buckets start at
    multiples of lcm(DP, 128), parameters at multiples of 64."""
    divisor = math.lcm(dp_size, 128, 2**16) if pad_for_busbw else math.lcm(dp_size, 128)
    index, unpadded = {}, []
    param_start = bucket_start = param_end = 0
    in_bucket = 0

    def close(end: int) -> int:
        nonlocal bucket_start, in_bucket
        unpadded.append(end - bucket_start)
        bucket_start, in_bucket = _pad(end, divisor), 0
        return bucket_start

    for name, numel in reversed(params):
        param_start = _pad(param_start, 64)
        if name in shared and in_bucket:
            param_start = close(param_start)
        param_end = param_start + numel
        index[name] = (len(unpadded), param_start - bucket_start, param_end - bucket_start)
        in_bucket += 1
        if (bucket_size is not None and param_end - bucket_start >= bucket_size) or name in shared:
            param_start = close(param_end)
        else:
            param_start = param_end
    if in_bucket:
        close(param_end)
    return index, unpadded


def bucket_layout(params: list[tuple[str, int]], dp_size: int, bucket_size: int | None,
                  shared: frozenset = frozenset(), pad_for_busbw: bool = False) -> tuple[dict, int]:
    """For `params` [(name, numel)] in named_parameters order: each name's (start, end) in the
    saved world tensors, and their length (numel_unpadded)."""
    positions, unpadded = bucket_positions(params, dp_size, bucket_size, shared, pad_for_busbw)
    offsets = [sum(unpadded[:b]) for b in range(len(unpadded))]
    return {name: (start + offsets[b], end + offsets[b]) for name, (b, start, end) in positions.items()}, sum(unpadded)
