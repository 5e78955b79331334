"""Attention of one block of queries against one block of keys and values, returning the
log-sum-exp of each query's scores, and its backward given the final log-sum-exp: the pieces
ring attention combines (the flash-attention recurrence written in plain torch).

Layouts: q [b, hq, sq, d], k and v [b, hg, sk, d] with hq a multiple of hg (grouped-query
attention: query head h uses key/value head h // (hq // hg)). Results are fp32. `mask`
(optional, --reset-attention-mask): bool [b, 1, sq, sk], True where attention is not allowed
(Megatron's convention), on top of the causal mask; a query whose keys in a block are all
masked gets output 0 and log-sum-exp -inf from that block.
"""

import torch

# How a block of queries relates to a block of keys of the same length: every key before
# every query, the same positions (causal mask inside), or every key after (skipped).
FULL, CAUSAL, SKIP = "full", "causal", "skip"


def relation(q_chunk: int, kv_chunk: int) -> str:
    if q_chunk > kv_chunk:
        return FULL
    return CAUSAL if q_chunk == kv_chunk else SKIP


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    return kv if kv.shape[1] == heads else kv.repeat_interleave(heads // kv.shape[1], dim=1)


def _scores(q, k, scale, causal, mask=None):
    s = torch.matmul(q.float(), _expand(k, q.shape[1]).float().transpose(-1, -2)) * scale
    if causal:
        future = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu_(1)
        s = s.masked_fill(future, float("-inf"))
    if mask is not None:
        s = s.masked_fill(mask, float("-inf"))
    return s


def _finite(lse: torch.Tensor) -> torch.Tensor:
    """lse with -inf (no key allowed) replaced by 0, so exp(-inf - it) is 0, not nan."""
    return lse.masked_fill(torch.isneginf(lse), 0.0)


def block_forward(q, k, v, scale: float, causal: bool, mask=None, keep=None):
    """(out [b, hq, sq, d], lse [b, hq, sq]) of q attending to k, v. `keep` (attention dropout,
    dropout.py): [b, hq, sq, sk] factors on the probabilities; the lse is dropout's input's."""
    s = _scores(q, k, scale, causal, mask)
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - _finite(lse).unsqueeze(-1))
    out = torch.matmul(p if keep is None else p * keep, _expand(v, q.shape[1]).float())
    return out, lse


def merge(acc, out, lse):
    """Merge a block's (out, lse) into the running (out, lse) `acc` (None: nothing yet)
    exactly: each part reweighted by exp(its lse - the combined lse)."""
    if acc is None:
        return out, lse
    acc_out, acc_lse = acc
    new_lse = torch.logaddexp(acc_lse, lse)
    finite = _finite(new_lse)
    new_out = (acc_out * torch.exp(acc_lse - finite).unsqueeze(-1)
               + out * torch.exp(lse - finite).unsqueeze(-1))
    return new_out, new_lse


def block_backward(q, k, v, dout, delta, lse, scale: float, causal: bool, mask=None, keep=None):
    """Gradients (dq [b, hq, sq, d], dk and dv [b, hg, sk, d]) of this block's share of the
    attention output, given the final `lse` and delta = rowsum(dout * out) of the merged output
    (with dropout too: rowsum(p * keep * dout v^T) is that same rowsum)."""
    hq, hg = q.shape[1], k.shape[1]
    p = torch.exp(_scores(q, k, scale, causal, mask) - _finite(lse).unsqueeze(-1))
    dout = dout.float()
    dv = torch.matmul(p.transpose(-1, -2) if keep is None else (p * keep).transpose(-1, -2), dout)
    dp = torch.matmul(dout, _expand(v, hq).float().transpose(-1, -2))
    if keep is not None:
        dp = dp * keep
    ds = p * (dp - delta.unsqueeze(-1))
    dq = torch.matmul(ds, _expand(k, hq).float()) * scale
    dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    if hq != hg:
        b, _, sk, d = dk.shape
        dk = dk.view(b, hg, hq // hg, sk, d).sum(2)
        dv = dv.view(b, hg, hq // hg, sk, d).sum(2)
    return dq, dk, dv


class TorchBlocks:
    """The block attention ring.py and gathered.py call, in plain torch (this module): any
    dtype, document masks and dropout. flash_blocks.FlashBlocks is the flash_attn one."""

    forward = staticmethod(block_forward)

    @staticmethod
    def attention(q, k, v, scale: float):
        """Causal attention of a whole sequence, autograd's: [b, hq, s, d] (a2a's)."""
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale,
                                                                enable_gqa=k.shape[1] != q.shape[1])

    @staticmethod
    def backward(q, k, v, dout, out, delta, lse, scale: float, causal: bool, mask=None, keep=None):
        """block_backward; `out` (the merged output whose rowsum(dout * out) is `delta`) is
        what a kernel computing delta itself takes."""
        return block_backward(q, k, v, dout, delta, lse, scale, causal, mask, keep)
