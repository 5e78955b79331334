"""The loss of a sequence split over the CP group: the masked mean over every CP rank's
tokens, so that it equals the loss of the unsplit sequence."""

import torch

from megalite.parallel import comm


def cp_masked_mean(per_token_loss: torch.Tensor, loss_mask: torch.Tensor | None, group) -> torch.Tensor:
    """sum over the CP group of sum(loss * mask), divided by the CP group's sum(mask).

    The numerator's all-reduce is the identity backward: each CP rank's parameters receive
    the gradient of the loss through its own tokens only, and summing those over the CP
    group (megalite.parallel.data sums gradients over CP) gives the full gradient."""
    if loss_mask is None:
        loss_mask = torch.ones_like(per_token_loss)
    loss_mask = loss_mask.to(per_token_loss.dtype)
    count = comm.all_reduce(loss_mask.sum().detach().clone(), group)
    total = comm.reduce_from_tensor_parallel_region((per_token_loss * loss_mask).sum(), group)
    return total / count
