"""Block attention through the flash_attn package (--use-flash-attn with context
parallelism), the kernel ring.py and gathered.py call in place of blocks.TorchBlocks.

Forward: flash_attn_func(..., return_attn_probs=True) returns each block's output and the
log-sum-exp of its scores, which ring attention merges. Backward: flash_attn_func's own
backward ignores the gradient of that log-sum-exp, so each block's share of the gradients
comes from flash_attn's _flash_attn_backward given the MERGED output and log-sum-exp (what
ring-attention implementations on flash_attn call), whose keyword arguments after `causal`
changed in flash_attn 2.6 (softcap) and 2.6.3 (window_size_left / window_size_right).

flash_attn takes [b, s, heads, d] in 16 bits on CUDA, grouped key/value heads as they are, one
head width for q, k and v (values narrower than the queries, multi-latent attention's, are
zero-padded to it and the results cut back: zeros change no score, output or gradient); no
masks and no dropout here (its dropout masks could not be those megalite's CP dropout
draws per block). Imported when first used: megalite imports without flash_attn.
"""

import torch
import torch.nn.functional as F


def flash_attn_module():
    """The flash_attn package, or an error naming --use-flash-attn."""
    try:
        import flash_attn
    except ImportError as e:
        raise RuntimeError("--use-flash-attn needs the flash_attn package, which is not importable") from e
    return flash_attn


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(part) for part in text.split("+")[0].split(".")[:3] if part.isdigit())


def backward_window_kwargs(version: str) -> dict:
    """The keyword arguments of _flash_attn_backward after `causal` that turn off the sliding
    window and softcapping, as flash_attn `version` names them."""
    if _version(version) >= (2, 6, 3):
        return {"window_size_left": -1, "window_size_right": -1, "softcap": 0.0}
    if _version(version) >= (2, 6):
        return {"window_size": (-1, -1), "softcap": 0.0}
    return {"window_size": (-1, -1)}


def _padded(t: torch.Tensor, head_dim: int) -> torch.Tensor:
    """[b, h, s, d] -> [b, s, h, d'], d' the head size rounded up to a multiple of 8 as
    flash_attn's kernels need (zeros change no score, output or gradient)."""
    t = t.transpose(1, 2)
    return F.pad(t, (0, head_dim - t.shape[-1])) if head_dim != t.shape[-1] else t


class FlashBlocks:
    """Block attention with flash_attn: q [b, hq, sq, d], k and v [b, hg, sk, d] as in
    blocks.py; results fp32 like TorchBlocks'."""

    def __init__(self):
        self.flash_attn = flash_attn_module()
        from flash_attn.flash_attn_interface import _flash_attn_backward

        self._backward = _flash_attn_backward
        self._window = backward_window_kwargs(getattr(self.flash_attn, "__version__", "0"))

    def attention(self, q, k, v, scale: float):
        """Causal attention of a whole sequence through flash_attn_func and its own backward:
        [b, hq, s, dv] (a2a's)."""
        dv = v.shape[-1]
        out = self.flash_attn.flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), _padded(v, q.shape[-1]),
                                              dropout_p=0.0, softmax_scale=scale, causal=True)
        return out[..., :dv].transpose(1, 2)

    def forward(self, q, k, v, scale: float, causal: bool, mask=None, keep=None):
        if mask is not None or keep is not None:
            raise ValueError("--use-flash-attn with context parallelism takes no attention mask and no "
                             "attention dropout")
        dv = v.shape[-1]
        padded = -(-max(q.shape[-1], dv) // 8) * 8
        out, lse, _ = self.flash_attn.flash_attn_func(
            *(_padded(t, padded) for t in (q, k, v)), dropout_p=0.0, softmax_scale=scale, causal=causal,
            return_attn_probs=True)
        return out[..., :dv].transpose(1, 2).float(), lse[..., :q.shape[2]].float()

    def backward(self, q, k, v, dout, out, delta, lse, scale: float, causal: bool, mask=None, keep=None):
        """This block's (dq, dk, dv), fp32, given the merged `out` and `lse` (flash_attn
        computes delta = rowsum(dout * out) itself)."""
        if mask is not None or keep is not None:
            raise ValueError("--use-flash-attn with context parallelism takes no attention mask and no "
                             "attention dropout")
        d, dv = q.shape[-1], v.shape[-1]
        padded = -(-max(d, dv) // 8) * 8
        q_, k_, v_ = (_padded(t, padded) for t in (q, k, v))
        dout_, out_ = (_padded(t.to(q.dtype), padded) for t in (dout, out))
        dq, dk, dv_ = (torch.empty(t.shape, dtype=t.dtype, device=t.device) for t in (q_, k_, v_))
        self._backward(dout_, q_, k_, v_, out_, lse.contiguous(), dq, dk, dv_, 0.0, scale, causal,
                       alibi_slopes=None, deterministic=False, rng_state=None, **self._window)
        return tuple(t[..., :width].transpose(1, 2).float() for t, width in ((dq, d), (dk, d), (dv_, dv)))
