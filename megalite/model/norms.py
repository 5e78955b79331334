"""LayerNorm and RMSNorm whose parameters know they are replicated over the TP group.

With `zero_centered` (--apply-layernorm-1p) the stored weight is gamma - 1: it starts at 0 and
the norm multiplies by (1 + weight), so weight decay pulls gamma towards 1, not 0.
"""

import torch
from torch import nn

from megalite import kernels

from megalite.parallel.sharding import mark_sequence_parallel


class _Norm(nn.Module):
    def __init__(self, hidden_size, eps, sequence_parallel, impl, params_dtype, device, zero_centered):
        super().__init__()
        self.eps, self.impl, self.zero_centered = eps, impl, zero_centered
        self.weight = mark_sequence_parallel(nn.Parameter(torch.empty(hidden_size, dtype=params_dtype, device=device)),
                                             sequence_parallel)
        self._reset_weight()

    def _reset_weight(self):
        nn.init.zeros_(self.weight) if self.zero_centered else nn.init.ones_(self.weight)

    def gamma(self) -> torch.Tensor:
        return self.weight + 1 if self.zero_centered else self.weight


class LayerNorm(_Norm):
    def __init__(self, hidden_size, eps=1e-5, *, sequence_parallel=False, impl="auto", params_dtype=torch.float32,
                 device=None, zero_centered=False):
        super().__init__(hidden_size, eps, sequence_parallel, impl, params_dtype, device, zero_centered)
        self.bias = mark_sequence_parallel(nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device)), sequence_parallel)

    def reset_parameters(self, generator=None):
        self._reset_weight()
        nn.init.zeros_(self.bias)

    def forward(self, x):
        return kernels.layer_norm(x, self.gamma(), self.bias, self.eps, impl=self.impl)


class RMSNorm(_Norm):
    """weight * (x / rms(x)), normalised in fp32 and cast back before the weight (as Llama)."""

    def __init__(self, hidden_size, eps=1e-5, *, sequence_parallel=False, impl="auto", params_dtype=torch.float32,
                 device=None, zero_centered=False):
        super().__init__(hidden_size, eps, sequence_parallel, impl, params_dtype, device, zero_centered)

    def reset_parameters(self, generator=None):
        self._reset_weight()

    def forward(self, x):
        return kernels.rms_norm(x, self.gamma(), self.eps, impl=self.impl)


def build_norm(config, *, size=None, partial_grad=None, device=None):
    """The configured norm over `size` channels (default the hidden size). `partial_grad`: the
    weight's gradient is partial per TP rank and summed over the TP group (default: under
    sequence parallelism)."""
    cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    partial = config.sequence_parallel if partial_grad is None else partial_grad
    return cls(size or config.hidden_size, config.norm_epsilon, sequence_parallel=partial, impl=config.kernel_impl,
               params_dtype=getattr(torch, config.params_dtype), device=device,
               zero_centered=config.apply_layernorm_1p)
