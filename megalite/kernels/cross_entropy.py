"""Cross-entropy over logits split along the vocabulary, in row chunks or per-row kernels so that
no fp32 copy of the whole [N, V] logits ever exists.

This rank holds logits [..., V_local] for global ids [vocab_start, vocab_start + V_local); only
the first `valid_vocab` local columns are real vocabulary, the rest (padding) is excluded from
the softmax. With z the fp32 logits, lse the log-sum-exp over the true vocabulary of V ids and
eps the label smoothing, the per-token loss is F.cross_entropy's:

    loss = (1 - eps) * (lse - z_target) + eps * (lse - mean_j z_j)

Each rank computes per-row max, sum of exponentials, target logit (0 where the target lies in
another shard) and sum of logits; max is all-reduced first, then the rescaled sums in one
all-reduce. The gradient, softmax - (1 - eps) onehot - eps / V (0 on padding), is local.
"""

import torch
import torch.distributed as dist

from megalite.kernels.dispatch import as_rows, check_triton_device, use_triton

# Rows per chunk of the torch path are chosen so that a chunk's fp32 copy has about this many elements.
TORCH_CHUNK_ELEMENTS = 1 << 24


def torch_local_stats(logits2d, local_target, n_valid: int, need_sum: bool,
                      chunk_elements: int = TORCH_CHUNK_ELEMENTS) -> torch.Tensor:
    """Torch twin of cross_entropy_triton.local_stats, one fp32 row chunk at a time: stacked
    [max, sum exp(z - max), z_target, (sum z)] -> [3 or 4, N]."""
    n_rows = logits2d.shape[0]
    out = torch.zeros((4 if need_sum else 3, n_rows), dtype=torch.float32, device=logits2d.device)
    if n_valid == 0:
        out[0].fill_(float("-inf"))
    rows_per_chunk = max(1, chunk_elements // max(n_valid, 1))
    for start in range(0, n_rows if n_valid > 0 else 0, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        z = logits2d[rows, :n_valid].to(torch.float32, copy=True)  # copy: sub_/exp_ below work in place
        row_max = z.amax(dim=-1)
        out[0, rows] = row_max
        if need_sum:
            out[3, rows] = z.sum(dim=-1)
        t = local_target[rows]
        out[2, rows] = torch.where(t >= 0, z.gather(1, t.clamp(min=0).unsqueeze(1)).squeeze(1), 0.0)
        out[1, rows] = z.sub_(row_max.unsqueeze(1)).exp_().sum(dim=-1)
    return out


def torch_grad_logits(logits2d, local_target, row_max, log_sum, grad_loss, n_valid: int, label_smoothing: float,
                      smooth: torch.Tensor, inplace: bool, chunk_elements: int = TORCH_CHUNK_ELEMENTS):
    """Torch twin of cross_entropy_triton.grad_logits(_), one fp32 row chunk at a time."""
    n_rows, n_cols = logits2d.shape
    grad = logits2d if inplace else torch.empty_like(logits2d)
    grad[:, n_valid:] = 0
    rows_per_chunk = max(1, chunk_elements // max(n_cols, 1))
    for start in range(0, n_rows if n_valid > 0 else 0, rows_per_chunk):
        rows = slice(start, start + rows_per_chunk)
        g = grad_loss[rows].unsqueeze(1)
        d = logits2d[rows, :n_valid].to(torch.float32, copy=True).sub_(row_max[rows].unsqueeze(1))
        d = d.sub_(log_sum[rows].unsqueeze(1)).exp_().sub_(smooth)  # exact where max + log sum would round
        t = local_target[rows]
        hit = (t >= 0).unsqueeze(1)
        d.scatter_add_(1, t.clamp(min=0).unsqueeze(1), torch.where(hit, label_smoothing - 1.0, 0.0))
        grad[rows, :n_valid] = d.mul_(g).to(grad.dtype)
    return grad


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


class _CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, vocab_start, valid_vocab, group, label_smoothing, inplace_backward, triton):
        if triton:
            from megalite.kernels import cross_entropy_triton

            stats_fn = cross_entropy_triton.local_stats
        else:
            stats_fn = torch_local_stats
        local_target = target.reshape(-1) - vocab_start
        local_target = torch.where((local_target >= 0) & (local_target < valid_vocab), local_target, -1)
        need_sum = label_smoothing > 0
        stats = stats_fn(as_rows(logits), local_target, valid_vocab, need_sum)
        row_max, sum_exp, z_target = stats[0], stats[1], stats[2]

        global_max = _all_reduce(row_max.clone(), dist.ReduceOp.MAX, group)
        pieces = [sum_exp * torch.exp(row_max - global_max), z_target]
        if need_sum:
            # A fill on the device, not torch.tensor([...], device=...): no host-to-device copy per step.
            pieces += [stats[3], sum_exp.new_full((1,), float(valid_vocab))]
        reduced = _all_reduce(torch.cat(pieces), dist.ReduceOp.SUM, group)
        n_rows = row_max.shape[0]
        log_sum_exp = torch.log(reduced[:n_rows])
        # Subtract the large terms from each other first: lse - z_t = log_sum_exp + (max - z_t),
        # exact even when the logits are large and lse would round at their magnitude.
        loss = log_sum_exp + (global_max - reduced[n_rows:2 * n_rows])
        if need_sum:
            vocab_size = reduced[-1:]  # stays on the device: no host sync
            mean_logit = reduced[2 * n_rows:3 * n_rows] / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_sum_exp + (global_max - mean_logit))
            smooth = label_smoothing / vocab_size
        else:
            smooth = torch.zeros(1, dtype=torch.float32, device=logits.device)

        ctx.save_for_backward(logits, local_target, global_max, log_sum_exp, smooth)
        ctx.triton, ctx.valid_vocab, ctx.label_smoothing = triton, valid_vocab, label_smoothing
        ctx.inplace_backward = inplace_backward
        return loss.view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local_target, global_max, log_sum_exp, smooth = ctx.saved_tensors
        args = (as_rows(logits), local_target, global_max, log_sum_exp, grad_loss.reshape(-1).float().contiguous(), ctx.valid_vocab,
                ctx.label_smoothing, smooth)
        if not ctx.triton:
            grad = torch_grad_logits(*args, ctx.inplace_backward)
        else:
            from megalite.kernels import cross_entropy_triton

            # Under torch.compile the out-of-place kernel is used: an opaque op may not mutate its input.
            inplace = ctx.inplace_backward and not torch.compiler.is_compiling()
            grad = (cross_entropy_triton.grad_logits_ if inplace else cross_entropy_triton.grad_logits)(*args)
        return grad.view(logits.shape), None, None, None, None, None, None, None


def cross_entropy(logits: torch.Tensor, target: torch.Tensor, *, vocab_start: int = 0, valid_vocab: int | None = None,
                  group=None, label_smoothing: float = 0.0, inplace_backward: bool = False,
                  impl: str = "auto") -> torch.Tensor:
    """Per-token fp32 cross-entropy of logits [..., V_local] (bf16 or fp32) against global target ids [...].

    logits is this rank's vocabulary shard, global ids [vocab_start, vocab_start + V_local), of
    which the first `valid_vocab` (default all) columns are real; `group` is the process group the
    vocabulary is sharded over (None = unsharded). Equals F.cross_entropy(reduction='none',
    label_smoothing=...) over the true vocabulary. The gradient comes back in the logits dtype;
    with inplace_backward=True it is written into the logits buffer (as Megatron does), which is
    safe only when nothing else reads those logits afterwards. impl: "auto" | "triton" | "torch".
    """
    if logits.dim() < 1 or not logits.is_floating_point():
        raise ValueError(f"cross_entropy: logits must be a floating-point [..., V] tensor, got {logits.dtype} "
                         f"{tuple(logits.shape)}")
    if tuple(target.shape) != tuple(logits.shape[:-1]) or target.is_floating_point():
        raise ValueError(f"cross_entropy: target must be integer ids of shape {tuple(logits.shape[:-1])}, got "
                         f"{target.dtype} {tuple(target.shape)}")
    local_vocab = logits.shape[-1]
    valid_vocab = local_vocab if valid_vocab is None else int(valid_vocab)
    if not 0 <= valid_vocab <= local_vocab or (group is None and valid_vocab == 0):
        raise ValueError(f"cross_entropy: valid_vocab must be in [{int(group is None)}, {local_vocab}] (the local "
                         f"vocabulary), got {valid_vocab}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    use = logits.numel() > 0 and use_triton("cross_entropy", impl, logits, target)
    if use:
        check_triton_device("cross_entropy", logits, target)
    return _CrossEntropyFunction.apply(logits, target.long(), int(vocab_start), valid_vocab, group,
                                       float(label_smoothing), bool(inplace_backward), use)
