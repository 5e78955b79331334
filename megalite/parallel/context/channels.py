"""Context parallelism for a layer that must see the whole sequence (Gated DeltaNet: a causal
convolution and a recurrence along it), as Megatron-Core's tensor_a2a_cp2hp / tensor_a2a_hp2cp:
an all-to-all trades this rank's two load-balanced chunks of the sequence (split.py), all
channels, for the whole sequence in natural order and 1/N of the channels; the inverse trades
back.

The channels are blocks of unequal sizes (`sections`, e.g. a fused projection's outputs), each
split into N equal parts on its own: CP rank r receives part r of every block, concatenated
in block order (Megatron's a2a_cp_to_hp head permutation). Layouts [s, b, channels].
"""

from itertools import accumulate

import torch

from megalite.parallel import comm
from megalite.parallel.context.gathered import heads_to_seq, seq_to_heads
from megalite.parallel.context.split import natural_order


def _parts_first(sections: tuple, n: int, device) -> torch.Tensor:
    """Channel index that orders the channels part by part: block 0's part 0, block 1's part 0,
    ..., block 0's part 1, ..."""
    if any(size % n for size in sections):
        raise ValueError(f"context-parallel channel split: blocks {tuple(sections)} are not each divisible by the "
                         f"context-parallel size {n}")
    starts = accumulate(sections[:-1], initial=0)
    blocks = [torch.arange(start, start + size, device=device).view(n, -1) for start, size in zip(starts, sections)]
    return torch.cat(blocks, dim=1).flatten()


def sequence_to_channels(x: torch.Tensor, sections: tuple, group) -> torch.Tensor:
    """x [s, b, sum(sections)], this rank's two chunks -> [n * s, b, sum(sections) / n]: the
    whole sequence in order, this rank's part of every block. Differentiable."""
    n = comm.group_size(group)
    if n == 1:
        return x
    s, b, c = x.shape
    x = x.index_select(2, _parts_first(sections, n, x.device)).reshape(s, b, n, c // n)
    full = comm.paired(x, seq_to_heads, heads_to_seq, group).reshape(n * s, b, c // n)
    return full.index_select(0, natural_order(s, n, x.device))


def channels_to_sequence(x: torch.Tensor, sections: tuple, group) -> torch.Tensor:
    """The inverse of sequence_to_channels: x [n * s, b, sum(sections) / n] -> [s, b,
    sum(sections)], this rank's two chunks, every block whole. Differentiable."""
    n = comm.group_size(group)
    if n == 1:
        return x
    ns, b, c = x.shape
    x = x.index_select(0, torch.argsort(natural_order(ns // n, n, x.device))).reshape(ns, b, 1, c)
    local = comm.paired(x, heads_to_seq, seq_to_heads, group).reshape(ns // n, b, n * c)
    return local.index_select(2, torch.argsort(_parts_first(sections, n, x.device)))
