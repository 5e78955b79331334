"""Context-parallel attention by collectives: `all_gather` (every rank gathers all keys and
values, its queries attend to those before them) and `a2a` (Ulysses: an all-to-all trades
the sequence split for a head split, each rank attends over the whole sequence for its
share of the heads, and a second all-to-all trades back).

Layouts: q [s, b, hq, d], k and v [s, b, hg, d], s this rank's two chunks (split.py).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel import comm
from megalite.parallel.context.split import chunk_ids, natural_order


class _GatherSequence(torch.autograd.Function):
    """All-gather dim 0 forward; backward sums every rank's gradient and keeps this rank's
    slice (reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return comm.all_gather_dim0(x, group)

    @staticmethod
    def backward(ctx, grad):
        return comm.reduce_scatter_dim0(grad, ctx.group), None


def all_gather_attention(q, k, v, group, scale: float) -> torch.Tensor:
    n, rank = comm.group_size(group), comm.group_rank(group)
    s = q.shape[0]
    c = s // 2
    kv = _GatherSequence.apply(torch.stack((k, v), dim=1), group)  # [n*s, 2, b, hg, d]
    kv = kv.index_select(0, natural_order(s, n, kv.device))
    outs = []
    for qa, q_id in enumerate(chunk_ids(n, rank)):
        keys = (q_id + 1) * c
        qc = q[qa * c:(qa + 1) * c].permute(1, 2, 0, 3)
        kc, vc = (kv[:keys, i].permute(1, 2, 0, 3) for i in (0, 1))
        allowed = torch.ones(c, keys, dtype=torch.bool, device=q.device).tril_(keys - c)
        outs.append(F.scaled_dot_product_attention(qc, kc, vc, attn_mask=allowed, scale=scale,
                                                   enable_gqa=kc.shape[1] != qc.shape[1]))
    return torch.cat(outs, dim=2)  # [b, hq, s, d]


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)  # (empty_like of a permuted view would keep its strides)
    dist.all_to_all_single(out, x, group=group)
    return out


class _SeqToHeads(torch.autograd.Function):
    """[s, b, h, d] split over the sequence -> [n*s, b, h/n, d] split over heads (rank order
    of the sequence parts); backward the inverse."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _seq_to_heads(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.group), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.group), None


def _seq_to_heads(x, group):
    n = comm.group_size(group)
    s, b, h, d = x.shape
    parts = x.reshape(s, b, n, h // n, d).permute(2, 0, 1, 3, 4)  # [n, s, b, h/n, d]
    return _all_to_all(parts, group).reshape(n * s, b, h // n, d)


def _heads_to_seq(x, group):
    n = comm.group_size(group)
    ns, b, hn, d = x.shape
    parts = _all_to_all(x.reshape(n, ns // n, b, hn, d), group)  # [n (heads), s, b, h/n, d]
    return parts.permute(1, 2, 0, 3, 4).reshape(ns // n, b, n * hn, d)


def a2a_attention(q, k, v, group, scale: float) -> torch.Tensor:
    n = comm.group_size(group)
    s, b, hq, d = q.shape
    if hq % n:
        raise ValueError(f"--cp-comm-type a2a needs the attention heads per tensor-parallel rank ({hq}) "
                         f"divisible by --context-parallel-size {n}")
    if k.shape[2] % n:  # too few key/value heads to split: give every query head its own copy
        k, v = (t.repeat_interleave(hq // t.shape[2], dim=2) for t in (k, v))
    order = natural_order(s, n, q.device)
    q, k, v = (_SeqToHeads.apply(t, group).index_select(0, order).permute(1, 2, 0, 3) for t in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                         enable_gqa=k.shape[1] != q.shape[1])  # [b, hq/n, n*s, d]
    out = out.permute(2, 0, 1, 3).index_select(0, torch.argsort(order))
    return _HeadsToSeq.apply(out, group).permute(1, 2, 0, 3)  # [b, hq, s, d]
