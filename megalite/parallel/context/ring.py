"""Ring attention (`--cp-comm-type p2p`): each rank's keys and values travel around the CP
ring while the block already here is computed; partial outputs are merged exactly with
their log-sum-exp, and (query chunk, key chunk) pairs a causal mask hides entirely are never
computed. The backward pass is a ring too: keys and values go round again, each block's
key/value gradient travelling with it and collecting every rank's contribution, arriving
home after one more hop.

Layouts: q and k [b, hq or hg, s, d], v [b, hg, s, dv] (dv: d, or multi-latent attention's
narrower values), s this rank's two chunks (split.py), or (hierarchical.py) any equal chunks a
Ring names. Keys and values travel as one tensor, concatenated along the channels.
"""

from dataclasses import dataclass


import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.context.blocks import CAUSAL, SKIP, TorchBlocks, merge, relation
from megalite.parallel.context.dropout import block_keep
from megalite.parallel.context.split import chunk_ids, mask_block

_KV_TAG, _GRAD_TAG = 0, 1


@dataclass(frozen=True)
class Ring:
    """Which ranks of `group` form the ring, in ring order (`members`), the sequence chunks
    each member holds (`chunks[i]` for members[i], in the order its tensors hold them), and
    the index of this rank's first head among the heads the dropout masks number."""

    members: tuple[int, ...]
    chunks: tuple[tuple[int, ...], ...]
    head_offset: int = 0

    @classmethod
    def whole_group(cls, group) -> "Ring":
        n = comm.group_size(group)
        return cls(tuple(range(n)), tuple(chunk_ids(n, r) for r in range(n)))


class _RingStep:
    """One hop of a tensor around the ring: started at once, waited for when needed."""

    def __init__(self, tensor, group, ring, tag, overlap):
        n, pos = len(ring.members), ring.members.index(comm.group_rank(group))
        self.received = torch.empty_like(tensor)
        send_to = dist.get_global_rank(group, ring.members[(pos + 1) % n])
        receive_from = dist.get_global_rank(group, ring.members[(pos - 1) % n])
        ops = [dist.P2POp(dist.isend, tensor, send_to, group, tag),
               dist.P2POp(dist.irecv, self.received, receive_from, group, tag)]
        self.requests = dist.batch_isend_irecv(ops)
        if not overlap:
            self.wait()

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        self.requests = []
        return self.received


def _pairs(ring, pos, src):
    """(query chunk index, key chunk index, query chunk id, key chunk id, causal) for each pair
    that is not skipped, ring member `pos`'s queries against member `src`'s keys."""
    q_ids, kv_ids = ring.chunks[pos], ring.chunks[src]
    for qa, q_id in enumerate(q_ids):
        for kb, kv_id in enumerate(kv_ids):
            kind = relation(q_id, kv_id)
            if kind != SKIP:
                yield qa, kb, q_id, kv_id, kind == CAUSAL


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, group, scale, overlap, dropout, ring, blocks):
        n, rank = len(ring.members), ring.members.index(comm.group_rank(group))
        parts = len(ring.chunks[rank])
        c = q.shape[2] // parts
        q_chunks = [q[:, :, i * c:(i + 1) * c] for i in range(parts)]
        acc = [None] * parts
        kv, d = torch.cat((k, v), dim=-1).contiguous(), k.shape[-1]
        for step in range(n):
            hop = _RingStep(kv, group, ring, _KV_TAG, overlap) if step < n - 1 else None
            src = (rank - step) % n
            for qa, kb, q_id, kv_id, causal in _pairs(ring, rank, src):
                kv_chunk = kv[:, :, kb * c:(kb + 1) * c]
                acc[qa] = merge(acc[qa], *blocks.forward(q_chunks[qa], kv_chunk[..., :d], kv_chunk[..., d:], scale, causal,
                                                         mask_block(mask, qa, kv_id, c),
                                                         block_keep(dropout, q_chunks[qa], q_id, kv_id, c,
                                                                    ring.head_offset)))
            if hop is not None:
                kv = hop.wait()
        out = torch.cat([a[0] for a in acc], dim=2)
        lse = torch.cat([a[1] for a in acc], dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.group, ctx.scale, ctx.overlap, ctx.dropout, ctx.ring = mask, group, scale, overlap, dropout, ring
        ctx.blocks = blocks
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mask, group, scale, overlap, dropout, ring = ctx.mask, ctx.group, ctx.scale, ctx.overlap, ctx.dropout, ctx.ring
        n, rank = len(ring.members), ring.members.index(comm.group_rank(group))
        parts = len(ring.chunks[rank])
        c = q.shape[2] // parts
        dout = dout.float()
        delta = (dout * out).sum(-1)
        pieces = lambda t: [t[:, :, i * c:(i + 1) * c] for i in range(parts)]  # noqa: E731
        q_chunks, dout_chunks, lse_chunks, delta_chunks = pieces(q), pieces(dout), pieces(lse), pieces(delta)
        out_chunks = pieces(out)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv, d = torch.cat((k, v), dim=-1).contiguous(), k.shape[-1]
        grad_hop = None
        for step in range(n):
            hop = _RingStep(kv, group, ring, _KV_TAG, overlap) if step < n - 1 else None
            src = (rank - step) % n
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for qa, kb, q_id, kv_id, causal in _pairs(ring, rank, src):
                sl = slice(kb * c, (kb + 1) * c)
                dq_part, dk_part, dv_part = ctx.blocks.backward(
                    q_chunks[qa], kv[:, :, sl, :d], kv[:, :, sl, d:], dout_chunks[qa], out_chunks[qa],
                    delta_chunks[qa], lse_chunks[qa], scale, causal, mask_block(mask, qa, kv_id, c),
                    block_keep(dropout, q_chunks[qa], q_id, kv_id, c, ring.head_offset))
                dq[:, :, qa * c:(qa + 1) * c] += dq_part
                dkv[:, :, sl, :d] += dk_part
                dkv[:, :, sl, d:] += dv_part
            if grad_hop is not None:
                dkv += grad_hop.wait()  # the earlier ranks' share of this same block
            if n > 1:
                grad_hop = _RingStep(dkv, group, ring, _GRAD_TAG, overlap)
            if hop is not None:
                kv = hop.wait()
        if n > 1:
            dkv = grad_hop.wait()  # this rank's own block, every rank's share summed
        return dq.to(q.dtype), dkv[..., :d].to(k.dtype), dkv[..., d:].to(v.dtype), None, None, None, None, None, None, None


def ring_attention(q, k, v, group, scale: float, overlap: bool = True, mask=None, dropout=None,
                   ring: Ring | None = None, blocks=TorchBlocks) -> torch.Tensor:
    """Causal attention of this rank's queries against every CP rank's keys and values.
    `overlap` False waits for each transfer before computing (to measure the overlap).
    `mask`: this rank's rows of the document mask (split.split_attention_mask) or None;
    `dropout`: a dropout.AttentionDropout or None; `ring`: the ring and its chunks (default:
    every rank of `group`, each holding its two load-balanced chunks); `blocks` the block
    attention (blocks.TorchBlocks, or flash_blocks.FlashBlocks())."""
    return RingAttention.apply(q, k, v, mask, group, scale, overlap, dropout, ring or Ring.whole_group(group), blocks)
