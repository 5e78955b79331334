"""Contiguous gradient buffers, split into buckets that are each reduced with one collective.

Every parameter of a model chunk gets a slice of one flat buffer (one buffer per parameter
dtype); `param.main_grad` is a view of that slice, and backward accumulates into it. Slices
are laid out in backward order (the reverse of parameter order), so the first bucket to be
complete is the first one in the buffer. A bucket closes once it holds `bucket_size` elements.

Each buffer is reduced over one group, its "data-parallel group": the DP group, DP x CP with
context parallelism (every CP rank holds the same parameters), the expert-data-parallel group
for experts. With the distributed optimizer each bucket is padded to a multiple of that group's
size d, so its rank r owns the contiguous slice [r·n/d, (r+1)·n/d) of every bucket: the
gradients are reduce-scattered into that slice and, after the update, the parameters are
all-gathered from it. For that the parameters themselves also live in a flat buffer of the
same layout (`param.data` becomes a view of it).

With several distributed-optimizer instances (--num-distributed-optimizer-instances N) the
group a bucket is sharded over is one instance's part of it (s = d / N ranks) and a second,
`replica_group`, joins the ranks holding the same shard in the other instances: the gradient is
reduce-scattered within the instance, then its shard all-reduced across the instances (as
Megatron's _ParamAndGradBucketGroup.start_grad_sync does), and the parameters are all-gathered
within the instance only.

Averaging over data-parallel ranks happens in the collective on NCCL (ReduceOp.AVG, which
pre-multiplies) and before it elsewhere (gloo's AVG sums first and could overflow in fp16).
"""

import math

import torch
import torch.distributed as dist

from megalite.parallel import comm

# NCCL-friendly alignment of each bucket's shards under the distributed optimizer (elements).
_SHARD_ALIGNMENT = 128


def _averaging(group, ranks: int) -> tuple:
    """(reduce op, factor to pre-multiply by) that average over `ranks` ranks without overflow
    (`group` tells the backend; chained AVGs over an instance and its replicas average over all)."""
    if dist.get_backend(group) == "nccl":
        return dist.ReduceOp.AVG, None
    return dist.ReduceOp.SUM, 1.0 / ranks


class Bucket:
    """Parameters whose gradients are reduced together, and their slice of the buffers."""

    def __init__(self, index: int, param_ranges: dict, grad_data: torch.Tensor,
                 param_data: torch.Tensor | None, dp_group, sharded: bool, grad_scale: float = 1.0,
                 replica_group=None):
        self.index = index
        self.param_ranges = param_ranges  # param -> (start, end) within this bucket
        self.params = list(param_ranges)
        self.grad_data, self.param_data = grad_data, param_data
        self.numel = grad_data.numel()
        self.dp_group, self.sharded, self.grad_scale = dp_group, sharded, grad_scale
        self.replica_group = replica_group  # the other instances' holders of this shard, or None
        self.dp_size = comm.group_size(dp_group)
        shards = self.dp_size if sharded else 1
        self.shard_size = self.numel // shards
        self.shard_start = comm.group_rank(dp_group) * self.shard_size if sharded else 0
        self.ready: set = set()
        self.grad_started = False
        self.grad_work = None
        self.param_work = None
        self._reduce_op = None  # set by start_grad_sync when the shard still needs its replica sum

    @property
    def shard_end(self) -> int:
        return self.shard_start + self.shard_size

    @property
    def sharded_over_dp(self) -> bool:
        """Whether each rank of dp_group holds only its shard (distributed optimizer, more than
        one rank)."""
        return self.sharded and self.dp_size > 1

    def grad_shard(self) -> torch.Tensor:
        """This rank's slice of the bucket's gradients (the whole bucket without sharding)."""
        return self.grad_data[self.shard_start:self.shard_end]

    def param_shard(self) -> torch.Tensor:
        return self.param_data[self.shard_start:self.shard_end]

    def mark_ready(self, param) -> bool:
        """Record that `param`'s gradient is final; True when the whole bucket is."""
        if param in self.ready:
            raise RuntimeError(f"bucket {self.index}: a parameter's gradient became ready twice in one "
                               "synchronising backward (missing no_sync() around earlier micro-batches?)")
        self.ready.add(param)
        return len(self.ready) == len(self.params)

    def start_grad_sync(self, async_op: bool) -> None:
        """Scale the bucket's gradients by grad_scale and average them over dp_group (all-reduce,
        or reduce-scatter into this rank's shard); a no-op if already started."""
        if self.grad_started:
            return
        self.grad_started = True
        if self.grad_scale != 1.0:
            self.grad_data.mul_(self.grad_scale)
        replicas = comm.group_size(self.replica_group)
        if self.dp_size * replicas == 1:
            return
        op, prescale = _averaging(self.dp_group if self.dp_size > 1 else self.replica_group, self.dp_size * replicas)
        if prescale is not None:
            self.grad_data.mul_(prescale)
        if self.dp_size > 1 and self.sharded:
            self.grad_work = comm.reduce_scatter_into(self.grad_shard(), self.grad_data, self.dp_group, op=op,
                                                      async_op=async_op)
        elif self.dp_size > 1:
            self.grad_work = dist.all_reduce(self.grad_data, op=op, group=self.dp_group, async_op=async_op)
        # the shard's sum across instances needs the reduce-scatter's result: finish_grad_sync
        self._reduce_op = op if replicas > 1 else None

    def finish_grad_sync(self) -> None:
        self.start_grad_sync(async_op=False)
        if self.grad_work is not None:
            self.grad_work.wait()
        self.grad_work = None
        if self._reduce_op is not None:
            dist.all_reduce(self.grad_shard(), op=self._reduce_op, group=self.replica_group)
            self._reduce_op = None

    def reset(self) -> None:
        self.ready.clear()
        self.grad_started = False
        self.grad_work = None
        self._reduce_op = None

    def start_param_sync(self, async_op: bool) -> None:
        """All-gather every rank's updated parameter shard into the parameter buffer."""
        if not self.sharded_over_dp:
            return
        self.finish_param_sync()
        self.param_work = dist.all_gather_single(self.param_data, self.param_shard(), group=self.dp_group,
                                                 async_op=async_op)

    def finish_param_sync(self) -> None:
        if self.param_work is not None:
            self.param_work.wait()
            self.param_work = None


class GradBuffer:
    """Flat main-gradient buffer (and, when sharded, parameter buffer) for parameters of one
    dtype, split into buckets.

    Args:
        params: parameters in model order (they are laid out in reverse).
        grad_dtype: dtype of the main gradients (fp32 by default, whatever the params are).
        bucket_size: elements per bucket (None: one bucket).
        dp_group: the group gradients are averaged over and, sharded, the optimizer state is
            sharded over (None: one rank).
        sharded: lay out for the distributed optimizer (padded buckets, a parameter buffer).
        own_bucket: predicate for parameters that must sit alone in a bucket.
        replica_group: with several distributed-optimizer instances, the ranks holding this
            rank's shard in the other instances (dp_group is then this instance's part).
        grad_scale: factor applied before averaging (over DP x CP: the CP size, since each CP
            rank's gradient is that of its part of every sequence and those are summed; expert
            gradients: 1 / EP size, so that averaging over the expert-data-parallel group
            divides by the whole DP size).
    """

    def __init__(self, params, *, grad_dtype, bucket_size, dp_group, sharded, own_bucket=lambda p: False,
                 grad_scale: float = 1.0, replica_group=None):
        params = list(params)
        if not params:
            raise ValueError("GradBuffer: no parameters")
        self.param_dtype, self.grad_dtype = params[0].dtype, grad_dtype
        self.device = params[0].device
        dp_size = comm.group_size(dp_group)
        pad_to = math.lcm(dp_size, _SHARD_ALIGNMENT) if sharded else 1

        layouts, current, offset, bucket_start = [], {}, 0, 0

        def close_bucket():
            nonlocal offset, bucket_start, current
            if current:
                offset = -(-offset // pad_to) * pad_to
                layouts.append((bucket_start, offset, current))
            current, bucket_start = {}, offset

        for param in reversed(params):
            if own_bucket(param):
                close_bucket()
            current[param] = (offset - bucket_start, offset - bucket_start + param.numel())
            offset += param.numel()
            if own_bucket(param) or (bucket_size is not None and offset - bucket_start >= bucket_size):
                close_bucket()
        close_bucket()

        self.numel = offset
        self.num_params = sum(p.numel() for p in params)
        self.grad_data = torch.zeros(offset, dtype=grad_dtype, device=self.device)
        self.param_data = torch.zeros(offset, dtype=self.param_dtype, device=self.device) if sharded else None
        self.buckets: list[Bucket] = []
        self.bucket_of: dict = {}
        for index, (start, end, ranges) in enumerate(layouts):
            param_data = self.param_data[start:end] if sharded else None
            bucket = Bucket(index, ranges, self.grad_data[start:end], param_data, dp_group, sharded, grad_scale,
                            replica_group)
            self.buckets.append(bucket)
            for param, (lo, hi) in ranges.items():
                self.bucket_of[param] = bucket
                if sharded:
                    view = param_data[lo:hi].view(param.shape)
                    view.copy_(param.data)
                    param.data = view
                param.main_grad = self.grad_data[start + lo:start + hi].view(param.shape)

    def zero(self) -> None:
        self.grad_data.zero_()
        for bucket in self.buckets:
            bucket.reset()
