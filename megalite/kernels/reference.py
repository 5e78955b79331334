"""Plain-torch references for megalite's fused kernels: the CPU path, the fallback, the oracle.

Each reference defines the op's semantics; the Triton kernel computes the same function with
fp32 arithmetic and one rounding to the output dtype (plus the one extra rounding RMSNorm's
definition has, below). Autograd through these functions gives the torch-path backward.
"""

import torch
import torch.nn.functional as F


def _wide(t: torch.Tensor) -> torch.Tensor:
    """t in fp32, or in fp64 when it already is (so the tests can evaluate references in fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Hugging Face Llama's RMSNorm, in its exact order: normalise in fp32, round to x.dtype, then
    scale by the weight; the result is cast to x.dtype.

        weight * (x.float() * rsqrt(mean(x.float()^2, -1) + eps)).to(x.dtype)
    """
    xf = _wide(x)
    normed = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (weight * normed).to(x.dtype)


def layer_norm_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float) -> torch.Tensor:
    """F.layer_norm over the last dim computed in fp32, cast to x.dtype."""
    return F.layer_norm(_wide(x), x.shape[-1:], _wide(weight), None if bias is None else _wide(bias), eps).to(x.dtype)


def swiglu_reference(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2f] laid out [gate | up] -> silu(gate) * up [..., f], in fp32, cast to x.dtype."""
    gate, up = _wide(x).chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)


def bias_gelu_reference(x: torch.Tensor, bias: torch.Tensor | None, approximate: str = "none") -> torch.Tensor:
    """gelu(x + bias) in fp32 ('none' = erf form, 'tanh' = tanh approximation), cast to x.dtype."""
    xf = _wide(x) if bias is None else _wide(x) + _wide(bias)
    return F.gelu(xf, approximate=approximate).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1 | x2] -> [-x2 | x1] along the last dim."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half convention, in fp32, cast to x.dtype.

    x [s, b, n, d]; cos, sin [s, 1 or b, d_rot] holding cat(freqs, freqs). The first d_rot
    channels become x*cos + rotate_half(x)*sin, the rest pass through unchanged.
    """
    d_rot = cos.shape[-1]
    cos, sin = _wide(cos).unsqueeze(2), _wide(sin).unsqueeze(2)
    x_rot = _wide(x[..., :d_rot])
    out = (x_rot * cos + rotate_half(x_rot) * sin).to(x.dtype)
    return out if d_rot == x.shape[-1] else torch.cat((out, x[..., d_rot:]), dim=-1)


def cross_entropy_reference(logits: torch.Tensor, target: torch.Tensor, label_smoothing: float = 0.0) -> torch.Tensor:
    """Unsharded per-token fp32 loss over the full vocabulary: F.cross_entropy on fp32 logits."""
    return F.cross_entropy(_wide(logits).reshape(-1, logits.shape[-1]), target.reshape(-1),
                           reduction="none", label_smoothing=label_smoothing).reshape(target.shape)


def bias_dropout_add_reference(x: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                               p: float) -> torch.Tensor:
    """residual + dropout(x + bias, p): Megatron's unfused bias-dropout-add (p = 0: no dropout)."""
    biased = x if bias is None else x + bias
    return residual + (F.dropout(biased, p, training=True) if p > 0 else biased)
