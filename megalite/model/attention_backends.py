"""Core attention by --attention-backend: scaled_dot_product_attention restricted to the
kernels a backend names, or megalite's explicit math path.

    auto             on CUDA, SDPA's kernels in the order attention_kernels.kernel_order gives for
                     the card (the measured fastest first; cuDNN first on sm90 / sm100 without a
                     measurement), math last; on CPU, SDPA picks
    flash            SDPA's flash kernel (on CPU too: torch has a CPU flash kernel)
    fused            SDPA's cuDNN kernel, else its memory-efficient one, on CUDA (Megatron: TE's
                     fused attention, cuDNN's); on CPU, where neither exists, SDPA's CPU flash kernel
    unfused, local   explicit softmax(q k^T * scale + mask) v, the softmax in fp32, dropout
                     on the probabilities (Megatron's unfused / local DotProductAttention;
                     16-bit memory as its fused softmax kernel unless
                     --attention-softmax-in-fp32, see explicit_attention)

Tensors are [b, n, s, d] as SDPA takes them; `mask` is bool [b or 1, 1, s_q, s_k] with True
where attention is allowed, None for causal. Values may be narrower than queries and keys
(multi-latent attention): SDPA's math, memory-efficient and cuDNN kernels and the explicit path
take them as they are; its flash kernel (CPU and CUDA) needs one width, so they are padded with
zeros to the query width there and the output cut back (zeros add nothing to any output).
"""

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from megalite.model.attention_kernels import call_of, card_of, kernel_order

_SDPA_KERNELS = {
    ("flash", "cuda"): [SDPBackend.FLASH_ATTENTION],
    ("flash", "cpu"): [SDPBackend.FLASH_ATTENTION],
    ("fused", "cpu"): [SDPBackend.FLASH_ATTENTION],
}
EXPLICIT_BACKENDS = ("unfused", "local")


def pad_values(v: torch.Tensor, width: int) -> torch.Tensor:
    """v with its last dim zero-padded to `width` (kernels that need one head width)."""
    return v if v.shape[-1] == width else F.pad(v, (0, width - v.shape[-1]))


def sdpa_kernels(backend: str, device_type: str) -> list | None:
    """The SDPA kernels `backend` allows on `device_type` but auto and fused on CUDA (ordered by
    attention_kernels.kernel_order); None means SDPA's own choice."""
    if backend == "auto":
        return None
    return _SDPA_KERNELS.get((backend, device_type))


def how_served(backend: str, device_type: str) -> str | None:
    """One start-up line saying how megalite serves --attention-backend, or None for auto."""
    if backend == "auto":
        return None
    if backend in EXPLICIT_BACKENDS:
        return (f"--attention-backend {backend}: megalite's explicit attention (q k^T, fp32 softmax, "
                "dropout, @ v), not scaled_dot_product_attention")
    if (backend, device_type) == ("fused", "cuda"):
        return ("--attention-backend fused: scaled_dot_product_attention's CUDNN_ATTENTION, else its "
                "EFFICIENT_ATTENTION where cuDNN cannot take the call (Transformer Engine's fused attention is cuDNN's)")
    kernels = _SDPA_KERNELS[(backend, device_type)]
    names = " / ".join(k.name for k in kernels)
    cpu = " (CPU has no cuDNN or memory-efficient kernel)" if (backend, device_type) == ("fused", "cpu") else ""
    return f"--attention-backend {backend}: scaled_dot_product_attention restricted to {names}{cpu}"


def explicit_attention(q, k, v, mask, *, dropout: float, scale: float, softmax_in_fp32: bool = True) -> torch.Tensor:
    """softmax(q k^T * scale) v with the softmax in fp32; grouped k/v heads are repeated. No
    mask is causal aligned as SDPA's is_causal (query i sees keys 0..i).

    16-bit q/k/v: with `softmax_in_fp32` (--attention-softmax-in-fp32) the scores come from the
    fp32 upcasts of q and k and the fp32 probabilities are kept for backward (Megatron's torch
    softmax path under that flag); without it, as Megatron's fused softmax kernel, the scores are
    a 16-bit matmul (fp32 accumulation, the scale applied before rounding) and the probabilities,
    computed in fp32, are kept in 16 bits: the 5 bytes per score of Korthikanti et al.'s
    activation formula (probabilities, dropout mask, dropout output) instead of 7, and no fp32
    copies of q and k. fp32 inputs take the first path either way."""
    if k.shape[1] != q.shape[1]:
        repeat = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    if softmax_in_fp32 or q.dtype == torch.float32:
        scores = torch.matmul(q.float(), k.float().transpose(-2, -1)) * scale
        scores = scores.masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(q.dtype)
    else:
        batch = q.shape[:2]
        scores = torch.baddbmm(q.new_empty(()), q.flatten(0, 1), k.flatten(0, 1).transpose(-2, -1), beta=0.0,
                               alpha=scale).unflatten(0, batch)
        # torch's softmax of 16-bit input accumulates in fp32 and keeps its 16-bit output, and so
        # does its backward (no fp32 buffer of the scores' size either way)
        probs = torch.softmax(scores.masked_fill_(~mask, float("-inf")), dim=-1)  # baddbmm keeps q, k only
    if dropout > 0:
        probs = F.dropout(probs, dropout, training=True)
    return torch.matmul(probs, v)


def core_attention(q, k, v, mask, *, backend: str, dropout: float, scale: float,
                   softmax_in_fp32: bool = True) -> torch.Tensor:
    """Attention of q [b, nq, s, d] over k, v [b, ng, s_k, d] with the chosen backend
    (`softmax_in_fp32`: the explicit backends' 16-bit choice, explicit_attention)."""
    if backend in EXPLICIT_BACKENDS:
        return explicit_attention(q, k, v, mask, dropout=dropout, scale=scale, softmax_in_fp32=softmax_in_fp32)
    call = dict(attn_mask=mask, dropout_p=dropout, is_causal=mask is None, scale=scale,
                enable_gqa=k.shape[1] != q.shape[1])
    if q.device.type == "cuda" and backend in ("auto", "fused"):
        order = kernel_order(backend, card_of(q.device.index), call_of(q, k, v, mask, dropout))
        with sdpa_kernel(list(order), set_priority=True):  # torch takes the first its checks accept
            return F.scaled_dot_product_attention(q, k, v, **call)
    kernels = sdpa_kernels(backend, q.device.type)
    if kernels is None:
        return F.scaled_dot_product_attention(q, k, v, **call)
    width = v.shape[-1]
    if kernels == [SDPBackend.FLASH_ATTENTION] and width != q.shape[-1]:
        with sdpa_kernel(kernels):
            return F.scaled_dot_product_attention(q, k, pad_values(v, q.shape[-1]), **call)[..., :width]
    with sdpa_kernel(kernels):
        return F.scaled_dot_product_attention(q, k, v, **call)
