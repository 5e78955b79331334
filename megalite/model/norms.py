"""LayerNorm and RMSNorm whose parameters know they are replicated over the TP group."""

import torch
from torch import nn

from megalite import kernels

from megalite.parallel.sharding import mark_sequence_parallel


class LayerNorm(nn.Module):
    def __init__(self, hidden_size, eps=1e-5, *, sequence_parallel=False, impl="auto", params_dtype=torch.float32,
                 device=None):
        super().__init__()
        self.eps, self.impl = eps, impl
        self.weight = mark_sequence_parallel(nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device)), sequence_parallel)
        self.bias = mark_sequence_parallel(nn.Parameter(torch.zeros(hidden_size, dtype=params_dtype, device=device)), sequence_parallel)

    def reset_parameters(self, generator=None):
        nn.init.ones_(self.weight)
        nn.init.zeros_(self.bias)

    def forward(self, x):
        return kernels.layer_norm(x, self.weight, self.bias, self.eps, impl=self.impl)


class RMSNorm(nn.Module):
    """weight * (x / rms(x)), normalised in fp32 and cast back before the weight (as Llama)."""

    def __init__(self, hidden_size, eps=1e-5, *, sequence_parallel=False, impl="auto", params_dtype=torch.float32,
                 device=None):
        super().__init__()
        self.eps, self.impl = eps, impl
        self.weight = mark_sequence_parallel(nn.Parameter(torch.ones(hidden_size, dtype=params_dtype, device=device)), sequence_parallel)

    def reset_parameters(self, generator=None):
        nn.init.ones_(self.weight)

    def forward(self, x):
        return kernels.rms_norm(x, self.weight, self.eps, impl=self.impl)


def build_norm(config, *, device=None):
    cls = RMSNorm if config.normalization == "RMSNorm" else LayerNorm
    return cls(config.hidden_size, config.norm_epsilon, sequence_parallel=config.sequence_parallel,
               impl=config.kernel_impl, params_dtype=getattr(torch, config.params_dtype), device=device)
