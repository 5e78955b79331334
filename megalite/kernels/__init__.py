"""Fused kernels for megalite: Triton on CUDA, plain-torch references on CPU and as the fallback.

Every op takes ``impl="auto" | "triton" | "torch"`` (see dispatch.py); "auto" picks Triton for
CUDA tensors when triton imports, unless speed_table.py records the torch reference as faster
on that GPU class and shape. On plain tensors in eager mode the Triton ops launch their kernels
directly from an autograd.Function of megalite's; under torch.compile, FakeTensorMode or any
dispatch mode they are torch.library operators (triton_common.eager_path). Importing this
package never imports triton.

    rms_norm(x, weight, eps)                      Llama-order RMSNorm over the last dim
    layer_norm(x, weight, bias, eps)              LayerNorm over the last dim (fp32 math)
    swiglu(x)                                     [..., 2f] = [gate | up] -> silu(gate) * up
    bias_gelu(x, bias, approximate)               gelu(x + bias), 'none' (erf) or 'tanh'
    bias_dropout_add(x, bias, residual, p)        residual + dropout(x + bias, p), the mask from Philox
    apply_rotary(x, cos, sin)                     rotate-half RoPE on x [s, b, n, d]
    cross_entropy(logits, target, *, vocab_start, valid_vocab, group, label_smoothing)
                                                  per-token fp32 loss, vocab-parallel aware
"""

from megalite.kernels.activations import bias_gelu, swiglu
from megalite.kernels.bias_dropout_add import bias_dropout_add
from megalite.kernels.cross_entropy import cross_entropy
from megalite.kernels.dispatch import IMPLS, triton_importable
from megalite.kernels.norms import layer_norm, rms_norm
from megalite.kernels.reference import (apply_rotary_reference, bias_dropout_add_reference, bias_gelu_reference,
                                        cross_entropy_reference, layer_norm_reference, rms_norm_reference,
                                        swiglu_reference)
from megalite.kernels.rotary import apply_rotary

__all__ = [
    "IMPLS", "apply_rotary", "apply_rotary_reference", "bias_dropout_add", "bias_dropout_add_reference", "bias_gelu", "bias_gelu_reference", "cross_entropy",
    "cross_entropy_reference", "layer_norm", "layer_norm_reference", "rms_norm", "rms_norm_reference", "swiglu",
    "swiglu_reference", "triton_importable",
]
