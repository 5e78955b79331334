"""Ring attention (`--cp-comm-type p2p`): each rank's keys and values travel around the CP
ring while the block already here is computed; partial outputs are merged exactly with
their log-sum-exp, and (query chunk, key chunk) pairs a causal mask hides entirely are never
computed. The backward pass is a ring too: keys and values go round again, each block's
key/value gradient travelling with it and collecting every rank's contribution, arriving
home after one more hop.

Layouts: q [b, hq, s, d], k and v [b, hg, s, d], s this rank's two chunks (split.py).
"""

import torch
import torch.distributed as dist

from megalite.parallel import comm
from megalite.parallel.context.blocks import CAUSAL, SKIP, block_backward, block_forward, merge, relation
from megalite.parallel.context.dropout import block_keep
from megalite.parallel.context.split import chunk_ids, mask_block

_KV_TAG, _GRAD_TAG = 0, 1


class _RingStep:
    """One hop of a tensor around the ring: started at once, waited for when needed."""

    def __init__(self, tensor, group, tag, overlap):
        n, rank = comm.group_size(group), comm.group_rank(group)
        self.received = torch.empty_like(tensor)
        ops = [dist.P2POp(dist.isend, tensor, dist.get_global_rank(group, (rank + 1) % n), group, tag),
               dist.P2POp(dist.irecv, self.received, dist.get_global_rank(group, (rank - 1) % n), group, tag)]
        self.requests = dist.batch_isend_irecv(ops)
        if not overlap:
            self.wait()

    def wait(self) -> torch.Tensor:
        for request in self.requests:
            request.wait()
        self.requests = []
        return self.received


def _pairs(cp_size, cp_rank, src_rank):
    """(query chunk index, key chunk index, query chunk id, key chunk id, causal) for each pair
    that is not skipped."""
    q_ids, kv_ids = chunk_ids(cp_size, cp_rank), chunk_ids(cp_size, src_rank)
    for qa, q_id in enumerate(q_ids):
        for kb, kv_id in enumerate(kv_ids):
            kind = relation(q_id, kv_id)
            if kind != SKIP:
                yield qa, kb, q_id, kv_id, kind == CAUSAL


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, group, scale, overlap, dropout):
        n, rank = comm.group_size(group), comm.group_rank(group)
        c = q.shape[2] // 2
        q_chunks = (q[:, :, :c], q[:, :, c:])
        acc = [None, None]
        kv = torch.stack((k, v)).contiguous()
        for step in range(n):
            hop = _RingStep(kv, group, _KV_TAG, overlap) if step < n - 1 else None
            src = (rank - step) % n
            for qa, kb, q_id, kv_id, causal in _pairs(n, rank, src):
                kv_chunk = kv[:, :, :, kb * c:(kb + 1) * c]
                acc[qa] = merge(acc[qa], *block_forward(q_chunks[qa], kv_chunk[0], kv_chunk[1], scale, causal,
                                                        mask_block(mask, qa, kv_id, c),
                                                        block_keep(dropout, q_chunks[qa], q_id, kv_id, c)))
            if hop is not None:
                kv = hop.wait()
        out = torch.cat((acc[0][0], acc[1][0]), dim=2)
        lse = torch.cat((acc[0][1], acc[1][1]), dim=2)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.mask, ctx.group, ctx.scale, ctx.overlap, ctx.dropout = mask, group, scale, overlap, dropout
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mask, group, scale, overlap, dropout = ctx.mask, ctx.group, ctx.scale, ctx.overlap, ctx.dropout
        n, rank = comm.group_size(group), comm.group_rank(group)
        c = q.shape[2] // 2
        dout = dout.float()
        delta = (dout * out).sum(-1)
        halves = lambda t: (t[:, :, :c], t[:, :, c:])  # noqa: E731
        q_chunks, dout_chunks, lse_chunks, delta_chunks = halves(q), halves(dout), halves(lse), halves(delta)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack((k, v)).contiguous()
        grad_hop = None
        for step in range(n):
            hop = _RingStep(kv, group, _KV_TAG, overlap) if step < n - 1 else None
            src = (rank - step) % n
            dkv = torch.zeros(kv.shape, dtype=torch.float32, device=kv.device)
            for qa, kb, q_id, kv_id, causal in _pairs(n, rank, src):
                sl = slice(kb * c, (kb + 1) * c)
                dq_part, dk_part, dv_part = block_backward(
                    q_chunks[qa], kv[0, :, :, sl], kv[1, :, :, sl], dout_chunks[qa], delta_chunks[qa],
                    lse_chunks[qa], scale, causal, mask_block(mask, qa, kv_id, c),
                    block_keep(dropout, q_chunks[qa], q_id, kv_id, c))
                dq[:, :, qa * c:(qa + 1) * c] += dq_part
                dkv[0, :, :, sl] += dk_part
                dkv[1, :, :, sl] += dv_part
            if grad_hop is not None:
                dkv += grad_hop.wait()  # the earlier ranks' share of this same block
            grad_hop = _RingStep(dkv, group, _GRAD_TAG, overlap)
            if hop is not None:
                kv = hop.wait()
        dkv = grad_hop.wait()  # this rank's own block, every rank's share summed
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None, None, None


def ring_attention(q, k, v, group, scale: float, overlap: bool = True, mask=None, dropout=None) -> torch.Tensor:
    """Causal attention of this rank's queries against every CP rank's keys and values.
    `overlap` False waits for each transfer before computing (to measure the overlap).
    `mask`: this rank's rows of the document mask (split.split_attention_mask) or None;
    `dropout`: a dropout.AttentionDropout or None."""
    return RingAttention.apply(q, k, v, mask, group, scale, overlap, dropout)
