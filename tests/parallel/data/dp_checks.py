"""Checks the data-parallel battery (test_data_parallel.py) runs inside its spawned ranks, each
returning a list of problems (empty: all good) so that one spawn checks many things:

- shard_layout_problems: under the distributed optimizer, DP x CP rank r owns exactly the contiguous
  slice [r·n/d, (r+1)·n/d) of every bucket (n padded to a multiple of lcm(d, 128)), and its
  main parameters, their gradients and their Adam state tile that slice exactly.
- overlapped_gather_problems: with --overlap-param-gather, step() leaves every bucket's
  parameter all-gather pending, the forward pre-hooks wait for it before each module runs, and
  that forward equals one run after waiting explicitly.
- FSDPNoSyncProbe: under FSDPChunk.no_sync (FSDP2's set_requires_gradient_sync(False)) a
  micro-batch's backward reduce-scatters nothing and leaves the sharded gradients empty; the
  last micro-batch's backward reduce-scatters.
"""

import math

import torch
import torch.distributed as dist

from megalite.model.gpt import masked_mean_loss

SHARD_ALIGNMENT = 128  # elements; what every bucket shard is padded to (with the DP size)


def _views(tensor: torch.Tensor, base: torch.Tensor, offset: int, numel: int) -> bool:
    """Whether `tensor` is exactly elements [offset, offset + numel) of the 1-D `base`."""
    return (tensor.numel() == numel and tensor.is_contiguous() and tensor.dtype == base.dtype
            and tensor.data_ptr() == base.data_ptr() + offset * base.element_size())


def shard_layout_problems(chunk, optimizer, pstate) -> list[str]:
    d, r = pstate.dp_size * pstate.cp_size, pstate.dp_cp_rank  # sharded over DP x CP
    shard_of = {id(shard.bucket): shard for shard in optimizer.bucket_shards}
    problems = []
    for bucket in chunk.buckets:
        where = f"rank {pstate.rank} bucket {bucket.index}"
        n = bucket.numel
        if n % math.lcm(d, SHARD_ALIGNMENT):
            problems.append(f"{where}: {n} elements, not a multiple of lcm({d}, {SHARD_ALIGNMENT})")
        if (bucket.shard_start, bucket.shard_size) != (r * n // d, n // d):
            problems.append(f"{where}: shard [{bucket.shard_start}, +{bucket.shard_size}), expected "
                            f"[{r * n // d}, +{n // d}) of {n}")
        shard = shard_of[id(bucket)]
        params_end = max(end for _, end in bucket.param_ranges.values())  # padding follows
        position, expected_end = bucket.shard_start, max(bucket.shard_start, min(bucket.shard_end, params_end))
        pieces = sorted(((bucket.param_ranges[m.param][0] + m.lo, bucket.param_ranges[m.param][0] + m.hi, m)
                         for m in shard.mains), key=lambda piece: piece[0])
        for start, end, m in pieces:
            if start != position:
                problems.append(f"{where}: main parameter {m.name} starts at {start}, expected {position}")
            position = end
            s0 = start - bucket.shard_start
            main_base, main_offset = ((bucket.param_data, start) if shard.main_flat is None
                                      else (shard.main_flat, s0))
            grad_base, grad_offset = ((bucket.grad_data, start) if shard.grad_flat is None
                                      else (shard.grad_flat, s0))
            if not _views(m.main, main_base, main_offset, end - start):
                problems.append(f"{where}: {m.name}'s main value is not its slice of the shard")
            if not _views(m.main.grad, grad_base, grad_offset, end - start):
                problems.append(f"{where}: {m.name}'s main gradient is not its slice of the shard")
            state = optimizer.inner.state.get(m.main, {})
            if any(state[key].shape != m.main.shape for key in ("exp_avg", "exp_avg_sq")):
                problems.append(f"{where}: {m.name}'s Adam state is not shaped like its shard piece")
        if position != expected_end:
            problems.append(f"{where}: main parameters end at {position}, expected {expected_end}")
    return problems


def overlapped_gather_problems(chunk, pstate, tokens, labels, mask) -> list[str]:
    """Call right after optimizer.step() with --overlap-param-gather."""
    problems = [f"rank {pstate.rank} bucket {b.index}: parameter all-gather not pending after step()"
                for b in chunk.buckets if b.param_work is None]

    def still_pending(module, _args):
        # Registered after megalite's pre-hooks, so it runs after them, just before the module.
        for param in module.parameters(recurse=False):
            bucket = chunk._bucket_of.get(param)
            if bucket is not None and bucket.param_work is not None:
                problems.append(f"rank {pstate.rank}: {type(module).__name__} runs before its bucket "
                                f"{bucket.index}'s all-gather was waited for")
    handles = [m.register_forward_pre_hook(still_pending) for m in chunk.module.modules()
               if any(p in chunk._bucket_of for p in m.parameters(recurse=False))]
    with torch.no_grad():
        overlapped = masked_mean_loss(chunk(tokens, labels=labels), mask)
    for handle in handles:
        handle.remove()
    problems += [f"rank {pstate.rank} bucket {b.index}: all-gather still pending after a forward"
                 for b in chunk.buckets if b.param_work is not None]
    chunk.finish_param_sync()
    with torch.no_grad():
        waited = masked_mean_loss(chunk(tokens, labels=labels), mask)
    if not torch.equal(overlapped, waited):
        problems.append(f"rank {pstate.rank}: forward with overlapped gather {overlapped.item()} != "
                        f"after waiting {waited.item()}")
    return problems


class FSDPNoSyncProbe:
    """Counts FSDP2's reduce-scatters (it calls torch.distributed.reduce_scatter_single) per
    micro-batch backward; pass `after_backward` to train_step, read `problems` afterwards."""

    def __init__(self, chunk, pstate):
        self.chunk, self.pstate, self.calls, self.problems = chunk, pstate, 0, []
        self._original = dist.reduce_scatter_single

    def __enter__(self):
        def counting(*args, **kwargs):
            self.calls += 1
            return self._original(*args, **kwargs)
        dist.reduce_scatter_single = counting
        return self

    def __exit__(self, *exc):
        dist.reduce_scatter_single = self._original

    def after_backward(self, micro_batch: int, last: bool) -> None:
        where = f"rank {self.pstate.rank} micro-batch {micro_batch}"
        with_grad = sum(p.grad is not None for p in self.chunk.module.parameters())
        if not last and (self.calls or with_grad):
            self.problems.append(f"{where} (under no_sync): {self.calls} reduce-scatters, "
                                 f"{with_grad} parameters with a sharded gradient")
        if last and not (self.calls and with_grad == len(list(self.chunk.module.parameters()))):
            self.problems.append(f"{where} (last): {self.calls} reduce-scatters, {with_grad} parameters "
                                 "with a sharded gradient")
