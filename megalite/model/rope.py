"""Rotary position embeddings: the angles, with Megatron's variants.

The rotation is megalite.kernels.apply_rotary in the rotate-half convention (Llama, Megatron's
default); `rotary_interleaved` rotates adjacent channel pairs instead (GPT-J, Megatron's
--rotary-interleaved), done here in plain torch.
"""

import math

import torch

# Llama 3.1's fixed RoPE scaling constants (Megatron hard-codes the same ones).
LLAMA3_LOW_FREQ_FACTOR = 1.0
LLAMA3_HIGH_FREQ_FACTOR = 4.0
LLAMA3_ORIGINAL_CONTEXT = 8192


def llama3_scaled_inv_freq(inv_freq: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1 frequency scaling: wavelengths longer than original_context / low_freq_factor
    are stretched by `factor`, shorter than original_context / high_freq_factor are kept, and
    those between blend the two linearly in original_context / wavelength."""
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_LOW_FREQ_FACTOR
    high_wavelen = LLAMA3_ORIGINAL_CONTEXT / LLAMA3_HIGH_FREQ_FACTOR
    smooth = (LLAMA3_ORIGINAL_CONTEXT / wavelen - LLAMA3_LOW_FREQ_FACTOR) / (
        LLAMA3_HIGH_FREQ_FACTOR - LLAMA3_LOW_FREQ_FACTOR)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, blended, scaled)


def rotary_inv_freq(rotary_dim: int, base: float, *, rope_scaling_factor: float | None = None,
                    device=None) -> torch.Tensor:
    """The rotary_dim / 2 angular frequencies base^(-2i / rotary_dim), fp32, optionally with
    Llama 3.1 scaling."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64, device=device).float() / rotary_dim
    inv_freq = 1.0 / (base ** exponents)
    if rope_scaling_factor is not None:
        inv_freq = llama3_scaled_inv_freq(inv_freq, rope_scaling_factor)
    return inv_freq


def rotary_cos_sin(seq_len: int, rotary_dim: int, base: float, device=None, *, interleaved: bool = False,
                   interpolation_factor: float | None = None,
                   rope_scaling_factor: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of shape [seq, 1, rotary_dim] (fp32) for positions 0..seq-1, each frequency
    repeated for its two channels: [f0..fn, f0..fn] (rotate-half) or [f0, f0, f1, f1, ...]
    (interleaved). `interpolation_factor` divides the positions."""
    inv_freq = rotary_inv_freq(rotary_dim, base, rope_scaling_factor=rope_scaling_factor, device=device)
    positions = torch.arange(seq_len, dtype=torch.int64, device=device).float()
    if interpolation_factor is not None:
        positions = positions / interpolation_factor
    freqs = torch.outer(positions, inv_freq)
    emb = freqs.repeat_interleave(2, dim=-1) if interleaved else torch.cat((freqs, freqs), dim=-1)
    emb = emb.unsqueeze(1)
    return emb.cos(), emb.sin()


def rotary_cos_sin_for(config, seq_len: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_cos_sin with a GPTConfig's RoPE settings."""
    return rotary_cos_sin(
        seq_len, int(config.kv_channels * config.rotary_percent), config.rotary_base, device,
        interleaved=config.rotary_interleaved, interpolation_factor=config.rotary_seq_len_interpolation_factor,
        rope_scaling_factor=config.rope_scaling_factor if config.use_rope_scaling else None)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Interleaved RoPE on x [s, b, n, d]: each pair (x[2i], x[2i+1]) is rotated by its angle;
    channels beyond cos' last dim pass through. Computed in fp32, returned in x's dtype."""
    rot = cos.shape[-1]
    xr, rest = x[..., :rot].float(), x[..., rot:]
    cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)  # [s, 1, 1, rot]
    even, odd = xr[..., 0::2], xr[..., 1::2]
    rotated = torch.stack((-odd, even), dim=-1).flatten(-2)
    out = (xr * cos + rotated * sin).to(x.dtype)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
