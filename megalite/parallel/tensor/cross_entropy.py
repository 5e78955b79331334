"""Cross-entropy over logits split along the vocabulary, never gathering full-vocabulary rows.

Rank i of the group holds logits for global ids [i*Vl, (i+1)*Vl). Max, sum of exponentials,
the target's logit and (for label smoothing) the sum of logits are reduced over the group; the
gradient is formed locally. Columns at or beyond the true vocabulary size (padding) are
excluded from the softmax, so the loss equals F.cross_entropy over the true vocabulary:

    loss = (1 - eps) * (lse - z_target) + eps * (lse - mean_j z_j)

The arithmetic lives in megalite.kernels.cross_entropy (a Triton kernel on GPUs, fp32 row
chunks in torch elsewhere); this function maps a TP rank to its vocabulary shard. Under
torch.compile the torch implementation is written instead as whole-tensor expressions
(`_traced_cross_entropy`).
"""

import torch
import torch.distributed as dist

from megalite.kernels import cross_entropy
from megalite.kernels.dispatch import use_triton
from megalite.parallel import comm


def vocab_parallel_cross_entropy(logits: torch.Tensor, target: torch.Tensor, group=None,
                                 vocab_size: int | None = None, label_smoothing: float = 0.0,
                                 impl: str = "auto", inplace_backward: bool = False) -> torch.Tensor:
    """Per-token fp32 loss for `logits` [..., V/t] (this rank's vocabulary shard) and `target` [...].

    `vocab_size` is the true vocabulary (default: every column of every rank is real)."""
    local_vocab = logits.shape[-1]
    vocab_start = comm.group_rank(group) * local_vocab
    if vocab_size is None:
        vocab_size = local_vocab * comm.group_size(group)
    valid = max(0, min(local_vocab, vocab_size - vocab_start))
    if torch.compiler.is_compiling() and not use_triton("cross_entropy", impl, logits, target):
        return _traced_cross_entropy(logits, target, group, vocab_start, valid, vocab_size, label_smoothing)
    return cross_entropy(logits, target, vocab_start=vocab_start, valid_vocab=valid, group=group,
                         label_smoothing=label_smoothing, inplace_backward=inplace_backward, impl=impl)


def _traced_cross_entropy(logits, target, group, vocab_start: int, valid: int, vocab_size: int,
                          label_smoothing: float) -> torch.Tensor:
    local_target = target.long() - vocab_start
    local_target = torch.where((local_target >= 0) & (local_target < valid), local_target, -1)
    return _TracedLoss.apply(logits, local_target, group, valid, vocab_size, label_smoothing)


class _TracedLoss(torch.autograd.Function):
    """The torch implementation as torch.compile should see it: whole-tensor expressions, so that
    inductor fuses the fp32 upcast into the forward's reductions and the gradient (softmax minus
    the smoothed one-hot, times the incoming gradient) into one pass over the 16-bit logits,
    which are all the backward keeps: no fp32 [tokens, vocabulary] tensor is ever materialised.
    (Left to autograd, the forward's exp would be saved in fp32; the eager torch path's fp32 row
    chunks, megalite.kernels.cross_entropy_torch, would be unrolled by Dynamo into about 100 copies
    of the graph at GPT-2's [32768, 50304] logits.)

    `local_target` is this shard's column of each target, -1 where it lies elsewhere. The row
    maximum is all-reduced with MAX, the sums in one all-reduce; each rank's gradient is that of
    its own shard, as the replicated loss needs."""

    @staticmethod
    def forward(ctx, logits, local_target, group, valid: int, vocab_size: int, label_smoothing: float):
        z = logits[..., :valid].float()
        if valid > 0:
            row_max = z.amax(dim=-1)
            picked = z.gather(-1, local_target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        else:  # every column of this shard is padding
            row_max = torch.full(local_target.shape, float("-inf"), dtype=torch.float32, device=logits.device)
            picked = torch.zeros(local_target.shape, dtype=torch.float32, device=logits.device)
        if comm.group_size(group) > 1:
            dist.all_reduce(row_max, op=dist.ReduceOp.MAX, group=group)
        shifted = z - row_max.unsqueeze(-1)
        sums = [shifted.exp().sum(dim=-1), torch.where(local_target >= 0, picked - row_max, 0.0)]
        if label_smoothing > 0:
            sums.append(shifted.sum(dim=-1))
        reduced = comm.all_reduce(torch.stack(sums), group)
        log_sum = reduced[0].log()
        loss = log_sum - reduced[1]
        if label_smoothing > 0:
            loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_sum - reduced[2] / vocab_size)
        ctx.save_for_backward(logits, local_target, row_max + log_sum)
        ctx.valid, ctx.vocab_size, ctx.label_smoothing = valid, vocab_size, label_smoothing
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        logits, local_target, log_normaliser = ctx.saved_tensors
        valid, eps = ctx.valid, ctx.label_smoothing
        softmax = (logits[..., :valid].float() - log_normaliser.unsqueeze(-1)).exp()
        hit = torch.arange(valid, device=logits.device) == local_target.unsqueeze(-1)
        grad = (softmax - eps / ctx.vocab_size - (1.0 - eps) * hit.float()) * grad_loss.unsqueeze(-1)
        grad = torch.nn.functional.pad(grad, (0, logits.shape[-1] - valid))
        return grad.to(logits.dtype), None, None, None, None, None
