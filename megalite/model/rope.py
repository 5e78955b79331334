"""Rotary position embeddings in the rotate-half convention (Llama, Megatron's default); the
rotation itself is megalite.kernels.apply_rotary."""

import torch


def rotary_cos_sin(seq_len: int, rotary_dim: int, base: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq, 1, rotary_dim] (fp32) for positions 0..seq-1."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.int64, device=device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return emb.cos(), emb.sin()
