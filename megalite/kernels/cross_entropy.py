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

from megalite.kernels.cross_entropy_torch import TorchLoss, torch_local_stats
from megalite.kernels.dispatch import as_rows, check_triton_device, use_triton


def _all_reduce(t: torch.Tensor, op, group) -> torch.Tensor:
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def _global_statistics(logits2d, local_target, valid_vocab: int, group, label_smoothing: float, triton: bool):
    """This rank's row statistics reduced over `group` (no autograd): (global max, log sum exp(z - max),
    target logit, mean logit or None, smooth = label_smoothing / V as a 1-element tensor)."""
    if triton:
        from megalite.kernels import cross_entropy_triton

        stats_fn = cross_entropy_triton.statistics
    else:
        stats_fn = torch_local_stats
    need_sum = label_smoothing > 0
    stats = stats_fn(logits2d, local_target, valid_vocab, need_sum)
    row_max, sum_exp, z_target = stats[0], stats[1], stats[2]
    if group is None or dist.get_world_size(group) == 1:
        # Nothing to reduce (the statistics are already global): a few torch ops fewer per call.
        if not need_sum:
            return row_max, torch.log(sum_exp), z_target, None, torch.zeros(1, dtype=torch.float32,
                                                                             device=logits2d.device)
        return (row_max, torch.log(sum_exp), z_target, stats[3] / valid_vocab,
                sum_exp.new_full((1,), label_smoothing / valid_vocab))

    global_max = _all_reduce(row_max.clone(), dist.ReduceOp.MAX, group)
    pieces = [sum_exp * torch.exp(row_max - global_max), z_target]
    if need_sum:
        # A fill on the device, not torch.tensor([...], device=...): no host-to-device copy per step.
        pieces += [stats[3], sum_exp.new_full((1,), float(valid_vocab))]
    reduced = _all_reduce(torch.cat(pieces), dist.ReduceOp.SUM, group)
    n_rows = row_max.shape[0]
    log_sum_exp = torch.log(reduced[:n_rows])
    if need_sum:
        vocab_size = reduced[-1:]  # stays on the device: no host sync
        mean_logit = reduced[2 * n_rows:3 * n_rows] / vocab_size
        smooth = label_smoothing / vocab_size
    else:
        mean_logit, smooth = None, torch.zeros(1, dtype=torch.float32, device=logits2d.device)
    return global_max, log_sum_exp, reduced[n_rows:2 * n_rows], mean_logit, smooth


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
    if target.shape != logits.shape[:-1] or target.is_floating_point():
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
    logits2d = as_rows(logits)
    if use and target.dtype == torch.int64 and (group is None or dist.get_world_size(group) == 1):
        from megalite.kernels import cross_entropy_triton

        flat = target if target.dim() == 1 and target.is_contiguous() else target.contiguous().view(-1)
        loss = cross_entropy_triton.unsharded_loss(logits2d, flat, int(vocab_start), valid_vocab,
                                                   float(label_smoothing), bool(inplace_backward))
        if loss is not None:  # the eager path; under torch.compile or a dispatch mode, the operators below
            return loss if flat is target else loss.view(target.shape)
    local_target = target.reshape(-1).long() - int(vocab_start)
    local_target = torch.where((local_target >= 0) & (local_target < valid_vocab), local_target, -1)
    statistics = _global_statistics(logits2d.detach(), local_target, valid_vocab, group, float(label_smoothing), use)
    args = (logits2d, local_target, *statistics, valid_vocab, float(label_smoothing), bool(inplace_backward))
    if use:
        from megalite.kernels import cross_entropy_triton

        loss = cross_entropy_triton.loss(*args)
    else:
        loss = TorchLoss.apply(*args)
    return loss.view(target.shape)
