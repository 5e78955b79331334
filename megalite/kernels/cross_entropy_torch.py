"""The torch path of the cross-entropy (cross_entropy.py): row statistics and the logits'
gradient one fp32 row chunk at a time (twins of cross_entropy_triton's kernels), and the loss
from the global statistics with its autograd, shared with the Triton path's operator.
"""

import torch

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


def loss_from_statistics(logits2d: torch.Tensor, local_target: torch.Tensor, global_max: torch.Tensor,
                         log_sum_exp: torch.Tensor, z_target: torch.Tensor, mean_logit: torch.Tensor | None,
                         smooth: torch.Tensor, valid_vocab: int, label_smoothing: float,
                         inplace_backward: bool) -> torch.Tensor:
    """The per-token loss from the rows' global statistics (cross_entropy.py), differentiable in
    logits2d: the operator megalite_kernels::cross_entropy_loss with the Triton kernel's gradient
    on the Triton path (cross_entropy_triton.py), TorchLoss with the torch twin's on the torch
    path (an autograd.Function, off the dispatcher: a custom op call imports torch._dynamo, and
    with it triton, in CPU runs that use neither)."""
    # lse - z_t = log_sum_exp + (max - z_t): the large terms subtracted from each other first,
    # exact even when the logits are large and lse would round at their magnitude.
    loss = log_sum_exp + (global_max - z_target)
    if mean_logit is not None:
        loss = (1.0 - label_smoothing) * loss + label_smoothing * (log_sum_exp + (global_max - mean_logit))
    return loss


def setup_loss(ctx, inputs, output):
    logits2d, local_target, global_max, log_sum_exp, _, _, smooth, *flags = inputs
    ctx.save_for_backward(logits2d, local_target, global_max, log_sum_exp, smooth)
    ctx.valid_vocab, ctx.label_smoothing, ctx.inplace_backward = flags


def grad_logits_args(ctx, grad_loss) -> tuple:
    """The arguments of grad_logits (either twin) from what setup_loss saved."""
    logits2d, local_target, global_max, log_sum_exp, smooth = ctx.saved_tensors
    return (logits2d, local_target, global_max, log_sum_exp, grad_loss.float().contiguous(), ctx.valid_vocab,
            ctx.label_smoothing, smooth)


NO_GRAD_BUT_LOGITS = (None,) * 9  # loss_from_statistics' other inputs


class TorchLoss(torch.autograd.Function):
    forward = staticmethod(loss_from_statistics)
    setup_context = staticmethod(setup_loss)

    @staticmethod
    def backward(ctx, grad_loss):
        return torch_grad_logits(*grad_logits_args(ctx, grad_loss), ctx.inplace_backward), *NO_GRAD_BUT_LOGITS
