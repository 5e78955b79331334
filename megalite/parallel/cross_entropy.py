"""Cross-entropy over logits split along the vocabulary, never gathering full-vocabulary rows.

Rank i holds logits for global ids [i*Vl, (i+1)*Vl). Max, sum of exponentials, the target's
logit and (for label smoothing) the sum of logits are reduced over the group; the gradient is
formed locally. Columns at or beyond the true vocabulary size (padding) are excluded from the
softmax, so the loss equals F.cross_entropy over the true vocabulary:

    loss = (1 - eps) * (lse - z_target) + eps * (lse - mean_j z_j)
"""

import torch
import torch.distributed as dist

from megalite.parallel import comm


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, vocab_size, label_smoothing):
        rank, local_vocab = comm.group_rank(group), logits.shape[-1]
        vocab_start = rank * local_vocab
        valid = max(0, min(local_vocab, vocab_size - vocab_start))
        z = logits.float().clone() if logits.dtype == torch.float32 else logits.float()
        if valid < local_vocab:
            z[..., valid:] = float("-inf")
        row_max = z.max(dim=-1).values
        if comm.group_size(group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        z -= row_max.unsqueeze(-1)

        local_target = target - vocab_start
        in_shard = (local_target >= 0) & (local_target < valid)
        local_target = local_target.masked_fill(~in_shard, 0)
        target_logit = z.gather(-1, local_target.unsqueeze(-1)).squeeze(-1).masked_fill(~in_shard, 0.0)

        smoothing_sum = z[..., :valid].sum(dim=-1) if label_smoothing > 0 else None
        exp = z.exp_()  # z is no longer needed as logits: reuse its storage for the softmax
        sums = [exp.sum(dim=-1), target_logit]
        if smoothing_sum is not None:
            sums.append(smoothing_sum)
        reduced = comm.all_reduce(torch.stack(sums), group)
        sum_exp, target_logit = reduced[0], reduced[1]
        log_sum_exp = torch.log(sum_exp)
        loss = log_sum_exp - target_logit
        if label_smoothing > 0:
            mean_logit = reduced[2] / vocab_size
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_sum_exp - mean_logit)

        softmax = exp.div_(sum_exp.unsqueeze(-1))
        ctx.save_for_backward(softmax, local_target, in_shard)
        ctx.label_smoothing, ctx.valid, ctx.vocab_size = label_smoothing, valid, vocab_size
        ctx.logits_dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, local_target, in_shard = ctx.saved_tensors
        eps = ctx.label_smoothing
        grad = softmax  # d loss / d z = softmax - (1-eps) onehot - eps/V on real columns
        grad.scatter_add_(-1, local_target.unsqueeze(-1), -(1.0 - eps) * in_shard.unsqueeze(-1).to(grad.dtype))
        if eps > 0:
            grad[..., : ctx.valid] -= eps / ctx.vocab_size
        grad *= grad_loss.unsqueeze(-1)
        return grad.to(ctx.logits_dtype), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 vocab_size: int | None = None, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-token fp32 loss for `logits` [..., V/t] (this rank's vocabulary shard) and `target` [...].

    `vocab_size` is the true vocabulary (default: all columns of all ranks are real)."""
    if vocab_size is None:
        vocab_size = logits.shape[-1] * comm.group_size(group)
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_size, label_smoothing)
