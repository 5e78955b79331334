"""Rotary position embeddings in the rotate-half convention (Llama, Megatron's default)."""

import torch


def rotary_cos_sin(seq_len: int, rotary_dim: int, base: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq, 1, rotary_dim] (fp32) for positions 0..seq-1."""
    inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim))
    freqs = torch.outer(torch.arange(seq_len, dtype=torch.int64, device=device).float(), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
    return emb.cos(), emb.sin()


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the first cos.shape[-1] channels of x [s, b, n, d]; cos/sin are [s, 1 or b, d_rot]."""
    rot = cos.shape[-1]
    cos, sin = cos.unsqueeze(2).to(x.dtype), sin.unsqueeze(2).to(x.dtype)
    x_rot = x[..., :rot]
    out = x_rot * cos + rotate_half(x_rot) * sin
    return out if rot == x.shape[-1] else torch.cat((out, x[..., rot:]), dim=-1)
