"""Context-parallel attention against unsharded causal attention: every comm type, grouped-
query and multi-head, forward and gradients, at CP = 2 and 4 (one spawn per world size);
and with a document mask (--reset-attention-mask) whose documents cross the chunk borders,
and with attention dropout (the whole-sequence mask of dropout.AttentionDropout); a2a+p2p
(hierarchical: a2a inside groups of A ranks, a ring across them) included."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from megalite.parallel.context import context_parallel_attention, gather_sequence, local_positions, split_sequence
from megalite.parallel.context.dropout import AttentionDropout
from megalite.parallel.context.split import natural_order, split_attention_mask
from tests.distributed import run_distributed
from tests.numerics import rel_error

# (query heads, key/value heads): multi-head, grouped-query, and GQA with fewer kv heads
# than CP ranks (a2a then copies kv heads).
HEAD_SHAPES = ((4, 4), (4, 2), (8, 1))
SEQ, BATCH, DIM = 32, 2, 8
# (comm type, overlap, a2a size): a2a+p2p (hierarchical) as A x P = 2 x 2 at CP 4, and at CP 2
# as 2 x 1 and 1 x 2 (all a2a, all ring).
_FLAT = (("p2p", True, 1), ("p2p", False, 1), ("all_gather", True, 1), ("a2a", True, 1))
COMM_CASES = {2: _FLAT + (("a2a+p2p", True, 2), ("a2a+p2p", True, 1)),
              4: _FLAT + (("a2a+p2p", True, 2), ("a2a+p2p", False, 2))}


def test_load_balanced_split():
    assert local_positions(8, 2, 0).tolist() == [0, 1, 6, 7]
    assert local_positions(8, 2, 1).tolist() == [2, 3, 4, 5]
    assert local_positions(16, 4, 3).tolist() == [6, 7, 8, 9]
    x = torch.arange(16)
    parts = torch.cat([split_sequence(x, 0, 4, r) for r in range(4)])
    assert torch.equal(parts[natural_order(4, 4)], x)
    with pytest.raises(ValueError, match="sequence length 12 is not divisible by 2 x --context-parallel-size 4"):
        local_positions(12, 4, 0)


def document_mask():
    """[BATCH, 1, SEQ, SEQ], True = masked out, as the dataset builds it for
    --reset-attention-mask: documents of lengths 3, 10, 19 in row 0 and 13, 2, 17 in row 1,
    so that documents start inside chunks and span several (chunks are 4 or 8 long here)."""
    docs = torch.tensor([[0] * 3 + [1] * 10 + [2] * 19, [0] * 13 + [1] * 2 + [2] * 17])
    causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
    return ~(causal & (docs[:, :, None] == docs[:, None, :]))[:, None]


def _reference(q, k, v, scale, mask=None, dropout=None):
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if dropout is not None:  # softmax, then the whole sequence's dropout mask, then @ v
        if mask is None:
            mask = ~torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        kb, vb = (t.repeat_interleave(qb.shape[1] // t.shape[1], dim=1) for t in (kb, vb))
        probs = torch.softmax((qb @ kb.transpose(-1, -2) * scale).masked_fill(mask, float("-inf")), dim=-1)
        positions = torch.arange(SEQ)
        out = probs * dropout.keep_scale(qb.shape[0], torch.arange(qb.shape[1]), positions, positions) @ vb
        return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)
    out = F.scaled_dot_product_attention(qb, kb, vb, attn_mask=None if mask is None else ~mask,
                                         is_causal=mask is None, scale=scale, enable_gqa=kb.shape[1] != qb.shape[1])
    return out.permute(2, 0, 1, 3).reshape(q.shape[0], q.shape[1], -1)


def _check_all(rank, world_size):
    """Max relative error of output and each gradient, per (comm type, heads, overlap, masked)."""
    group = dist.group.WORLD
    errors = {}
    cases = [(*shape, False, None) for shape in HEAD_SHAPES] + [(4, 2, True, None), (8, 1, True, None)]
    cases += [(4, 2, False, AttentionDropout(0.3, 1234)), (8, 1, True, AttentionDropout(0.5, 99))]
    for hq, hg, masked, dropout in cases:
        mask = document_mask() if masked else None
        local_mask = None if mask is None else split_attention_mask(mask, world_size, rank)
        gen = torch.Generator().manual_seed(hq * 10 + hg)
        q = torch.randn(SEQ, BATCH, hq, DIM, generator=gen, requires_grad=True)
        k = torch.randn(SEQ, BATCH, hg, DIM, generator=gen, requires_grad=True)
        v = torch.randn(SEQ, BATCH, hg, DIM, generator=gen, requires_grad=True)
        weight = torch.randn(SEQ, BATCH, hq * DIM, generator=gen)
        scale = DIM ** -0.5
        ref = _reference(q, k, v, scale, mask, dropout)
        (ref * weight).sum().backward()
        for comm_type, overlap, a2a_size in COMM_CASES[world_size]:
            local = [split_sequence(t.detach(), 0, world_size, rank).requires_grad_() for t in (q, k, v)]
            out = context_parallel_attention(*local, group, comm_type, scale, overlap=overlap, mask=local_mask,
                                             dropout=dropout, a2a_size=a2a_size)
            (out * split_sequence(weight, 0, world_size, rank)).sum().backward()
            full = [gather_sequence(t, 0, group) for t in (out.detach(), *(t.grad for t in local))]
            expected = (ref.detach(), q.grad, k.grad, v.grad)
            key = (comm_type, a2a_size, overlap, hq, hg, masked, dropout and dropout.p)
            errors[key] = max(rel_error(a, b) for a, b in zip(full, expected))
    return errors


@pytest.mark.parametrize("world_size", [2, 4])
def test_context_parallel_attention_matches_unsharded(world_size):
    for errors in run_distributed(_check_all, world_size):
        bad = {key: err for key, err in errors.items() if err > 1e-5}
        assert not bad, bad
        assert len(errors) == len(COMM_CASES[world_size]) * (len(HEAD_SHAPES) + 4)


def test_dropout_mask_is_bernoulli_and_seeded():
    """Keep rate 1 - p (within 5 standard deviations) over 2 x 4 x 256 x 256 entries, no
    correlation between neighbouring keys, a different mask for another seed, the same for
    the same seed."""
    positions = torch.arange(256)
    for p in (0.1, 0.5):
        keep = AttentionDropout(p, 7).keep_scale(2, torch.arange(4), positions, positions) > 0
        n = keep.numel()
        assert abs(keep.float().mean().item() - (1 - p)) < 5 * (p * (1 - p) / n) ** 0.5
        both = (keep[..., 1:] & keep[..., :-1]).float().mean().item()
        assert abs(both - (1 - p) ** 2) < 5 * ((1 - p) ** 2 / n) ** 0.5
        again = AttentionDropout(p, 7).keep_scale(2, torch.arange(4), positions, positions) > 0
        other = AttentionDropout(p, 8).keep_scale(2, torch.arange(4), positions, positions) > 0
        assert torch.equal(keep, again) and not torch.equal(keep, other)
        assert not torch.equal(keep[0], keep[1]) and not torch.equal(keep[:, 0], keep[:, 1])
