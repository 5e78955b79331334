"""Grouped matmul of the experts: rows [N, in] grouped by expert times one weight per expert.

torch._grouped_mm (one kernel for every expert) where the device supports it: CUDA with
compute capability 9.0 or newer, bf16 operands, widths multiples of 8; a loop of matmuls
otherwise (CPU, other dtypes), which computes the same products.
"""

import torch


def torch_grouped_mm_usable(x: torch.Tensor, weights: torch.Tensor) -> bool:
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == torch.bfloat16
            and weights.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
            and x.shape[-1] % 8 == 0 and weights.shape[-1] % 8 == 0)


def grouped_mm(x: torch.Tensor, weights: torch.Tensor, counts: list[int], use_grouped: bool = True) -> torch.Tensor:
    """x [N, in] whose first counts[0] rows belong to expert 0, the next counts[1] to expert 1,
    ...; weights [E, in, out]. Returns [N, out]."""
    if use_grouped and torch_grouped_mm_usable(x, weights):
        offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
        return torch._grouped_mm(x, weights, offs=offsets)
    # No shortcut for zero rows: the empty products keep the output in the autograd graph, so a
    # rank whose experts got no tokens still runs the backward's dispatcher collectives (its
    # all-to-all, gathers and reduce-scatters) with the ranks that did; a fresh empty tensor
    # would cut them out of its backward and leave those ranks waiting there.
    return torch.cat([rows @ w for rows, w in zip(x.split(counts), weights.unbind(0))])
