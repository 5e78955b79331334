"""The load-balanced split of a sequence over N context-parallel ranks.

The sequence is cut into 2N equal chunks and rank i holds chunks i and 2N-1-i, in that
order (Megatron-LM and torchtitan split the same way): under a causal mask the early chunk
attends to few keys and the late one to many, so every rank does the same work.
"""

import torch

from megalite.parallel import comm


def chunk_ids(cp_size: int, cp_rank: int) -> tuple[int, int]:
    """The two chunks (of 2 * cp_size) that `cp_rank` holds, in the order it holds them."""
    return cp_rank, 2 * cp_size - 1 - cp_rank


def _check_divisible(seq_len: int, cp_size: int) -> None:
    if seq_len % (2 * cp_size):
        raise ValueError(f"sequence length {seq_len} is not divisible by 2 x --context-parallel-size "
                         f"{cp_size} = {2 * cp_size}")


def local_positions(seq_len: int, cp_size: int, cp_rank: int, device=None) -> torch.Tensor:
    """Positions in the full sequence of length `seq_len` of the tokens `cp_rank` holds."""
    _check_divisible(seq_len, cp_size)
    chunk = seq_len // (2 * cp_size)
    return torch.cat([torch.arange(c * chunk, (c + 1) * chunk, device=device)
                      for c in chunk_ids(cp_size, cp_rank)])


def split_sequence(x: torch.Tensor, dim: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """`cp_rank`'s two chunks of the full sequence along `dim`."""
    if cp_size == 1:
        return x
    return x.index_select(dim, local_positions(x.shape[dim], cp_size, cp_rank, x.device))


def natural_order(local_len: int, cp_size: int, device=None) -> torch.Tensor:
    """Index that puts the ranks' concatenated local sequences back into sequence order:
    full = concatenated[natural_order(...)]."""
    held = torch.cat([local_positions(local_len * cp_size, cp_size, r) for r in range(cp_size)])
    return torch.argsort(held).to(device)


def gather_sequence(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    """The full sequence along `dim` from every CP rank's local part (no autograd)."""
    n = comm.group_size(group)
    if n == 1:
        return x
    gathered = comm.gather_dim(x, dim, group)
    return gathered.index_select(dim, natural_order(x.shape[dim], n, x.device))


def split_attention_mask(mask: torch.Tensor, cp_size: int, cp_rank: int) -> torch.Tensor:
    """`cp_rank`'s rows (its queries) of a full [b, 1, s, s] attention mask; the columns (keys)
    stay the whole sequence in order: [b, 1, s / cp_size, s]."""
    if cp_size == 1:
        return mask
    return mask.index_select(2, local_positions(mask.shape[2], cp_size, cp_rank, mask.device))


def mask_block(mask: torch.Tensor | None, q_half: int, kv_chunk: int, chunk: int):
    """The part of a split_attention_mask for this rank's query half `q_half` (0 or 1) against
    sequence chunk `kv_chunk` (chunks of length `chunk`); None without a mask."""
    if mask is None:
        return None
    return mask[:, :, q_half * chunk:(q_half + 1) * chunk, kv_chunk * chunk:(kv_chunk + 1) * chunk]
