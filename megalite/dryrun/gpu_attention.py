"""scaled_dot_product_attention on a fake CUDA device as a GPU would run it.

A CPU-only torch has no CUDA kernel to choose between, so F.scaled_dot_product_attention on
fake CUDA tensors falls back to its math decomposition, which stores the s x s scores: a
memory figure no GPU run shows. On an sm80+ GPU, SDPA runs flash attention for bf16/fp16
without a mask (grouped k/v heads as they are, one head width for q, k and v) and
memory-efficient attention otherwise (values narrower than the queries included); this
mode calls those ATen ops directly, whose fake implementations and backward formulas give the
same outputs and saved tensors the GPU run has.
"""

from types import SimpleNamespace

import torch
import torch.nn.functional as F


_SDPA = F.scaled_dot_product_attention


def gpu_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if not q.is_cuda:
        return _SDPA(q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, scale=scale,
                     enable_gqa=enable_gqa)
    same_width = v.shape[-1] == q.shape[-1]  # flash needs one head width (MLA's values are narrower)
    if attn_mask is None and q.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] <= 256 and same_width:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False,
                                                                  scale=scale)[0]
    if k.shape[1] != q.shape[1]:  # memory-efficient attention takes one k/v head per query head
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    bias = attn_mask
    if bias is not None:
        if bias.dtype == torch.bool:
            bias = torch.zeros(bias.shape, dtype=q.dtype, device=q.device).masked_fill(~bias, float("-inf"))
        bias = bias.expand(q.shape[0], q.shape[1], q.shape[2], k.shape[2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, dropout_p, is_causal,
                                                                  scale=scale)[0]


MODELLED_CAPABILITY = (9, 0)
"""The GPU a dry run models (an H100): what torch.cuda.get_device_capability answers, so that the
choices made on it (torch._grouped_mm for the MoE experts) are those of that GPU."""
MODELLED_PROPERTIES = SimpleNamespace(name="NVIDIA H100 80GB HBM3 (modelled by a dry run)", major=9, minor=0,
                                      multi_processor_count=132, total_memory=80 * 2**30)
"""What torch.cuda.get_device_properties answers (the Triton kernels size their grids by the SM count)."""
_CAPABILITY = torch.cuda.get_device_capability
_PROPERTIES = torch.cuda.get_device_properties


class GpuAttention:
    """Within this context F.scaled_dot_product_attention on CUDA tensors is `gpu_sdpa` (a
    function replaced, not a mode: activation recompute in backward must take the same path),
    and torch.cuda.get_device_capability and get_device_properties answer MODELLED_CAPABILITY and
    MODELLED_PROPERTIES (a CPU-only torch has neither)."""

    def __enter__(self):
        F.scaled_dot_product_attention = gpu_sdpa
        torch.cuda.get_device_capability = lambda device=None: MODELLED_CAPABILITY
        torch.cuda.get_device_properties = lambda device=None: MODELLED_PROPERTIES
        return self

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = _SDPA
        torch.cuda.get_device_capability = _CAPABILITY
        torch.cuda.get_device_properties = _PROPERTIES
