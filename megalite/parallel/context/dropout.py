"""Attention dropout under context parallelism.

Megatron-LM (Transformer Engine's context-parallel attention) draws each block's dropout mask
from the device RNG inside the block's kernel, so its masks depend on the CP size and comm
type and no CP=N run draws CP=1's masks. megalite makes the mask a function of where the
probability sits instead: the keep decision for (sample b, head h, query position i, key
position j) is a hash of (seed, b, h, i, j), with the seed drawn once per attention call from
the model-parallel RNG stream (equal on every CP rank, as in Megatron). Every block then
draws exactly its part of one whole-sequence mask: ring, all_gather and a2a at any CP size
apply the same masks, forward and recomputed in backward (nothing of size seq x seq kept),
and the keep probability is 1 - p for every entry, independent of every other.
"""

from dataclasses import dataclass

import torch

_LOW32 = 0xFFFFFFFF
_MULT = 0x45D9F3B  # (a 32-bit integer hash's multiplier; below 2**31 so products fit in int64)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = (x * _MULT) & _LOW32
    x = x ^ (x >> 16)
    x = (x * _MULT) & _LOW32
    return x ^ (x >> 16)


@dataclass(frozen=True)
class AttentionDropout:
    """Dropout probability `p` and the call's `seed` (any integer)."""

    p: float
    seed: int

    def keep_scale(self, batch: int, heads: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        """fp32 [batch, len(heads), len(q_pos), len(k_pos)]: 1 / (1 - p) where the probability
        is kept, 0 where dropped. `heads` are the heads' indices on this tensor-parallel rank,
        positions those in the whole sequence."""
        device = q_pos.device
        sample = torch.arange(batch, device=device)
        key = (sample[:, None] * 65599 + heads.to(device)[None]) & _LOW32
        h = _mix(_mix(key) ^ (self.seed & _LOW32))
        h = _mix(h[:, :, None] ^ (q_pos & _LOW32))
        u = _mix(h[:, :, :, None] ^ (k_pos & _LOW32))
        keep = u >= int(self.p * 2 ** 32)
        return keep.float() / (1.0 - self.p)


def chunk_positions(chunk: int, length: int, device) -> torch.Tensor:
    """Positions in the whole sequence of sequence chunk `chunk` (chunks of `length`)."""
    return torch.arange(chunk * length, (chunk + 1) * length, device=device)


def block_keep(dropout: AttentionDropout | None, q: torch.Tensor, q_chunk: int, kv_chunk: int, length: int,
               head_offset: int = 0):
    """keep_scale for the block of q [b, hq, length, d] (heads head_offset onwards) at sequence
    chunk `q_chunk` against chunk `kv_chunk`; None without dropout."""
    if dropout is None:
        return None
    heads = torch.arange(head_offset, head_offset + q.shape[1])
    return dropout.keep_scale(q.shape[0], heads, chunk_positions(q_chunk, length, q.device),
                              chunk_positions(kv_chunk, length, q.device))
