"""The transformer MLP: GeLU (GPT-2), SwiGLU (Llama) or squared ReLU, column- then row-parallel."""

import torch
import torch.nn.functional as F
from torch import nn

from megalite import kernels

from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


class MLP(nn.Module):
    def __init__(self, config, tp_group=None, device=None):
        super().__init__()
        self.config = config
        swiglu = config.activation == "swiglu"
        dtype = getattr(torch, config.params_dtype)
        # SwiGLU's fc1 holds [gate; up]; stride 2 gives each TP rank [gate_r; up_r].
        self.linear_fc1 = ColumnParallelLinear(
            config.hidden_size, config.ffn_hidden_size * (2 if swiglu else 1), tp_group=tp_group,
            bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel, stride=2 if swiglu else 1,
            init_std=config.hidden_init_std, skip_bias_add=not swiglu, params_dtype=dtype, device=device)
        self.linear_fc2 = RowParallelLinear(
            config.ffn_hidden_size, config.hidden_size, tp_group=tp_group, bias=config.add_bias_linear,
            sequence_parallel=config.sequence_parallel,
            init_std=config.output_proj_init_std, params_dtype=dtype, device=device)

    def forward(self, x):
        activation = self.config.activation
        if activation == "swiglu":
            return self.linear_fc2(kernels.swiglu(self.linear_fc1(x), impl=self.config.kernel_impl_for("swiglu")))
        y, bias = self.linear_fc1(x)  # the bias is added inside the fused GeLU
        if activation == "squared_relu":
            return self.linear_fc2(F.relu(y if bias is None else y + bias).square())
        approximate = "tanh" if activation == "openai_gelu" else "none"
        return self.linear_fc2(kernels.bias_gelu(y, bias, approximate, impl=self.config.kernel_impl_for("bias_gelu")))
