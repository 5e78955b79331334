"""Cross-entropy over logits split along the vocabulary, never gathering full-vocabulary rows.

Rank i of the group holds logits for global ids [i*Vl, (i+1)*Vl). Max, sum of exponentials,
the target's logit and (for label smoothing) the sum of logits are reduced over the group; the
gradient is formed locally. Columns at or beyond the true vocabulary size (padding) are
excluded from the softmax, so the loss equals F.cross_entropy over the true vocabulary:

    loss = (1 - eps) * (lse - z_target) + eps * (lse - mean_j z_j)

The arithmetic lives in megalite.kernels.cross_entropy (a Triton kernel on GPUs, fp32 row
chunks in torch elsewhere); this function maps a TP rank to its vocabulary shard.
"""

import torch

from megalite.kernels import cross_entropy
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
    return cross_entropy(logits, target, vocab_start=vocab_start, valid_vocab=valid, group=group,
                         label_smoothing=label_smoothing, inplace_backward=inplace_backward, impl=impl)
