"""Causal self-attention across a context-parallel group, by `--cp-comm-type`."""

from megalite.parallel.context.blocks import TorchBlocks
from megalite.parallel.context.gathered import a2a_attention, all_gather_attention
from megalite.parallel.context.hierarchical import hierarchical_attention
from megalite.parallel.context.ring import ring_attention

CP_COMM_TYPES = ("p2p", "all_gather", "a2a", "a2a+p2p")


def context_parallel_attention(q, k, v, group, comm_type: str, scale: float, overlap: bool = True,
                               mask=None, dropout=None, a2a_size: int = 1, blocks=TorchBlocks):
    """q and k [s, b, hq or hg, d], v [s, b, hg, dv] (dv: d, or multi-latent attention's value
    width): this rank's two chunks of the sequence (split.split_sequence). Returns the context
    [s, b, hq * dv] of causal attention over the whole sequence. `overlap` (p2p only) False waits for each ring transfer before computing.
    `mask` (--reset-attention-mask): bool [b, 1, s, s * cp], this rank's query rows of the
    whole sequence's mask, True where not allowed (split.split_attention_mask), or None.
    `dropout`: a dropout.AttentionDropout (the same masks for every comm type and CP size), or None.
    `a2a_size` (a2a+p2p only): the a2a group size A of --hierarchical-context-parallel-sizes A P.
    `blocks`: the attention kernel, blocks.TorchBlocks or flash_blocks.FlashBlocks() (which
    takes no mask and no dropout)."""
    s, b = q.shape[:2]
    if s % 2:
        raise ValueError(f"context-parallel attention: local sequence length {s} is not two equal chunks")
    if blocks is not TorchBlocks and (mask is not None or dropout is not None):
        raise ValueError("--use-flash-attn with context parallelism takes no attention mask (--reset-attention-mask) "
                         "and no attention dropout (--attention-dropout > 0)")
    if comm_type == "p2p":
        out = ring_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), group, scale, overlap, mask, dropout,
                             blocks=blocks)
    elif comm_type == "all_gather":
        out = all_gather_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v)), group, scale, mask, dropout, blocks)
    elif comm_type == "a2a":
        out = a2a_attention(q, k, v, group, scale, mask, dropout, blocks)
    elif comm_type == "a2a+p2p":
        out = hierarchical_attention(q, k, v, group, a2a_size, scale, overlap, mask, dropout, blocks)
    else:
        raise ValueError(f"--cp-comm-type {comm_type!r}: expected one of {', '.join(CP_COMM_TYPES)}")
    return out.permute(2, 0, 1, 3).reshape(s, b, -1)
