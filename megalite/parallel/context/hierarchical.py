"""Hierarchical context parallelism (`--cp-comm-type a2a+p2p` with
`--hierarchical-context-parallel-sizes A P`): the CP group of A x P ranks is A-rank a2a groups
(consecutive CP ranks, innermost, as Megatron orders them) and P-rank rings across them.
An all-to-all inside each a2a group trades the sequence split for a head split (each rank
then holds its group's 2A chunks for 1/A of the heads); ring attention (ring.py) runs across
the P groups among the ranks holding the same heads; a second all-to-all trades back.

Both run on the CP group itself: the a2a's all_to_all_single sends nothing to ranks outside
the a2a group, and the ring's transfers name their peers, so no further process groups are
needed. Layouts: q [s, b, hq, d], k and v [s, b, hg, d], s this rank's two chunks.
"""

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.context.blocks import TorchBlocks
from megalite.parallel.context.ring import Ring, ring_attention
from megalite.parallel.context.split import chunk_ids


def _sub_all_to_all(parts: torch.Tensor, group, members: range) -> torch.Tensor:
    """parts [len(members), ...]: part i goes to CP rank members[i]; returns what each member
    sent here, in member order."""
    n = comm.group_size(group)
    rows = parts.shape[1] if parts.dim() > 1 else 1
    sizes = [rows if r in members else 0 for r in range(n)]
    flat = parts.contiguous().reshape(len(members) * rows, -1)
    out = torch.empty_like(flat)
    dist.all_to_all_single(out, flat, sizes, sizes, group=group)
    return out.reshape(parts.shape)


def _seq_to_heads(x, group, members):
    a = len(members)
    s, b, h, d = x.shape
    parts = x.reshape(s, b, a, h // a, d).permute(2, 0, 1, 3, 4)  # [a, s, b, h/a, d]
    return _sub_all_to_all(parts, group, members).reshape(a * s, b, h // a, d)


def _heads_to_seq(x, group, members):
    a = len(members)
    as_, b, ha, d = x.shape
    parts = _sub_all_to_all(x.reshape(a, as_ // a, b, ha, d), group, members)  # [a (heads), s, b, h/a, d]
    return parts.permute(1, 2, 0, 3, 4).reshape(as_ // a, b, a * ha, d)


def hierarchical_attention(q, k, v, group, a2a_size: int, scale: float, overlap: bool = True,
                           mask=None, dropout=None, blocks=TorchBlocks) -> torch.Tensor:
    """q [s, b, hq, d], k and v [s, b, hg, d] -> [b, hq, s, d]: causal attention over the
    whole sequence, a2a inside groups of `a2a_size` consecutive CP ranks, a ring across them.
    `mask`, `dropout` and `blocks` as in context_parallel_attention."""
    n, rank = comm.group_size(group), comm.group_rank(group)
    if n % a2a_size:
        raise ValueError(f"--hierarchical-context-parallel-sizes: a2a size {a2a_size} does not divide the "
                         f"context-parallel size {n}")
    a, p = a2a_size, n // a2a_size
    s, b, hq, d = q.shape
    if hq % a:
        raise ValueError(f"--cp-comm-type a2a+p2p needs the attention heads per tensor-parallel rank ({hq}) "
                         f"divisible by the a2a size {a}")
    if k.shape[2] % a:  # too few key/value heads to split: give every query head its own copy
        k, v = (t.repeat_interleave(hq // t.shape[2], dim=2) for t in (k, v))
    group_index, inner = divmod(rank, a)
    members = range(group_index * a, (group_index + 1) * a)
    q, k, v = (comm.paired(t, _seq_to_heads, _heads_to_seq, group, members).permute(1, 2, 0, 3)
               for t in (q, k, v))
    if mask is not None:  # this a2a group's query rows, in member order like the queries now
        rows = _sub_all_to_all(mask.to(torch.uint8).movedim(2, 0)[None].expand(a, *mask.movedim(2, 0).shape),
                               group, members)
        mask = rows.reshape(a * s, *rows.shape[2:]).movedim(0, 2).bool()
    ring = Ring(members=tuple(g * a + inner for g in range(p)),
                chunks=tuple(tuple(c for m in range(g * a, (g + 1) * a) for c in chunk_ids(n, m)) for g in range(p)),
                head_offset=inner * (hq // a))
    out = ring_attention(q, k, v, group, scale, overlap, mask, dropout, ring, blocks)  # [b, hq/a, a*s, d]
    out = comm.paired(out.permute(2, 0, 1, 3), _heads_to_seq, _seq_to_heads, group, members)
    return out.permute(1, 2, 0, 3)
