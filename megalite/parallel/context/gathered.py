"""Context-parallel attention by collectives: `all_gather` (every rank gathers all keys and
values, its queries attend to those before them, blockwise) and `a2a` (Ulysses: an all-to-all trades
the sequence split for a head split, each rank attends over the whole sequence for its
share of the heads, and a second all-to-all trades back).

Layouts: see each function; s is this rank's two chunks (split.py).
"""

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel import comm
from megalite.parallel.context.blocks import TorchBlocks, block_forward, merge
from megalite.parallel.context.dropout import block_keep
from megalite.parallel.context.split import chunk_ids, gather_sequence, mask_block, natural_order


def _chunk_place(chunk: int, cp_size: int) -> tuple[int, int]:
    """(owning CP rank, which of its two halves) of sequence chunk `chunk`."""
    return (chunk, 0) if chunk < cp_size else (2 * cp_size - 1 - chunk, 1)


class AllGatherAttention(torch.autograd.Function):
    """Keys and values gathered from every CP rank; each local query chunk attends to the
    chunks before it and, causally, its own (blocks.py, merged by log-sum-exp, so nothing of
    size seq x seq is kept for backward). Backward gathers them again and reduce-scatters
    their gradients home."""

    @staticmethod
    def forward(ctx, q, k, v, mask, group, scale, dropout, blocks):
        n, rank = comm.group_size(group), comm.group_rank(group)
        c, d = q.shape[2] // 2, k.shape[-1]
        kv = comm.all_gather_dim0(torch.cat((k, v), dim=-1).unsqueeze(0), group)  # [n, b, hg, s, d + dv]
        outs, lses = [], []
        for qa, q_id in enumerate(chunk_ids(n, rank)):
            acc = None
            for kv_id in range(q_id + 1):
                owner, half = _chunk_place(kv_id, n)
                block = kv[owner, :, :, half * c:(half + 1) * c]
                q_part = q[:, :, qa * c:(qa + 1) * c]
                acc = merge(acc, *blocks.forward(q_part, block[..., :d], block[..., d:], scale, kv_id == q_id,
                                                 mask_block(mask, qa, kv_id, c),
                                                 block_keep(dropout, q_part, q_id, kv_id, c)))
            outs.append(acc[0])
            lses.append(acc[1])
        out, lse = torch.cat(outs, dim=2), torch.cat(lses, dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.group, ctx.scale, ctx.dropout, ctx.blocks = mask, group, scale, dropout, blocks
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mask, group, scale, dropout = ctx.mask, ctx.group, ctx.scale, ctx.dropout
        n, rank = comm.group_size(group), comm.group_rank(group)
        c, d = q.shape[2] // 2, k.shape[-1]
        kv = comm.all_gather_dim0(torch.cat((k, v), dim=-1).unsqueeze(0), group)
        dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
        dout = dout.float()
        delta = (dout * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        for qa, q_id in enumerate(chunk_ids(n, rank)):
            rows = slice(qa * c, (qa + 1) * c)
            for kv_id in range(q_id + 1):
                owner, half = _chunk_place(kv_id, n)
                cols = slice(half * c, (half + 1) * c)
                dq_part, dk_part, dv_part = ctx.blocks.backward(
                    q[:, :, rows], kv[owner, :, :, cols, :d], kv[owner, :, :, cols, d:], dout[:, :, rows],
                    out[:, :, rows], delta[:, :, rows], lse[:, :, rows], scale, kv_id == q_id, mask_block(mask, qa, kv_id, c),
                    block_keep(dropout, q[:, :, rows], q_id, kv_id, c))
                dq[:, :, rows] += dq_part
                dkv[owner, :, :, cols, :d] += dk_part
                dkv[owner, :, :, cols, d:] += dv_part
        dkv = comm.reduce_scatter_dim0(dkv, group)[0]
        return dq.to(q.dtype), dkv[..., :d].to(k.dtype), dkv[..., d:].to(v.dtype), None, None, None, None, None


def all_gather_attention(q, k, v, group, scale: float, mask=None, dropout=None, blocks=TorchBlocks) -> torch.Tensor:
    """q [b, hq, s, d], k and v [b, hg, s, d] -> [b, hq, s, d]; `mask` this rank's rows of
    the document mask (split.split_attention_mask) or None; `dropout` a
    dropout.AttentionDropout or None; `blocks` the block attention (blocks.TorchBlocks, or
    flash_blocks.FlashBlocks())."""
    return AllGatherAttention.apply(q, k, v, mask, group, scale, dropout, blocks)


def _all_to_all(x: torch.Tensor, group) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)  # (empty_like of a permuted view would keep its strides)
    dist.all_to_all_single(out, x, group=group)
    return out


def seq_to_heads(x, group):
    """[s, b, h, d], this rank's part of the sequence -> [n * s, b, h / n, d]: every rank's
    part (rank order) of this rank's 1/n of the heads (the Ulysses all-to-all)."""
    n = comm.group_size(group)
    s, b, h, d = x.shape
    parts = x.reshape(s, b, n, h // n, d).permute(2, 0, 1, 3, 4)  # [n, s, b, h/n, d]
    return _all_to_all(parts, group).reshape(n * s, b, h // n, d)


def heads_to_seq(x, group):
    """The inverse of seq_to_heads (and its gradient)."""
    n = comm.group_size(group)
    ns, b, hn, d = x.shape
    parts = _all_to_all(x.reshape(n, ns // n, b, hn, d), group)  # [n (heads), s, b, h/n, d]
    return parts.permute(1, 2, 0, 3, 4).reshape(ns // n, b, n * hn, d)


def a2a_attention(q, k, v, group, scale: float, mask=None, dropout=None, blocks=TorchBlocks) -> torch.Tensor:
    """q [s, b, hq, d], k and v [s, b, hg, d] -> [b, hq, s, d]; `mask` this rank's rows of the
    document mask (split.split_attention_mask) or None; `dropout` a dropout.AttentionDropout
    or None (then the whole-sequence attention of this rank's heads is computed explicitly,
    its mask that of heads rank * hq / n onwards); `blocks` whose causal attention runs
    without mask and dropout (blocks.TorchBlocks: SDPA, or flash_blocks.FlashBlocks())."""
    n = comm.group_size(group)
    s, b, hq, d = q.shape
    if hq % n:
        raise ValueError(f"--cp-comm-type a2a needs the attention heads per tensor-parallel rank ({hq}) "
                         f"divisible by --context-parallel-size {n}")
    if k.shape[2] % n:  # too few key/value heads to split: give every query head its own copy
        k, v = (t.repeat_interleave(hq // t.shape[2], dim=2) for t in (k, v))
    order = natural_order(s, n, q.device)
    q, k, v = (comm.paired(t, seq_to_heads, heads_to_seq, group).index_select(0, order).permute(1, 2, 0, 3)
               for t in (q, k, v))
    allowed = None
    if mask is not None:  # every rank attends over the whole sequence: it needs every row
        full = gather_sequence(mask.to(torch.uint8), 2, group).bool()  # (gloo gathers no bool)
        allowed = ~full & torch.ones(full.shape[-2:], dtype=torch.bool, device=full.device).tril()
    if dropout is None and mask is None:
        out = blocks.attention(q, k, v, scale)  # [b, hq/n, n*s, d]
    elif dropout is None:
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, scale=scale,
                                             enable_gqa=k.shape[1] != q.shape[1])
    else:
        keep = block_keep(dropout, q, 0, 0, n * s, head_offset=comm.group_rank(group) * q.shape[1])
        out = block_forward(q, k, v, scale, True, None if allowed is None else ~allowed, keep)[0].to(q.dtype)
    out = out.permute(2, 0, 1, 3).index_select(0, torch.argsort(order))
    return comm.paired(out, heads_to_seq, seq_to_heads, group).permute(1, 2, 0, 3)  # [b, hq, s, d]
