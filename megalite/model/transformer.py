"""A pre-norm transformer layer: x + Attn(Norm(x)), then x + MLP(Norm(x))."""

import torch.nn.functional as F
from torch import nn

from megalite.model.attention import SelfAttention
from megalite.model.mla import MLASelfAttention
from megalite.model.mlp import MLP
from megalite.model.moe import MoELayer
from megalite.model.norms import build_norm
from megalite.parallel.random import rng_fork_if


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_number: int, tp_group=None, rng_tracker=None, device=None, expert_state=None,
                 cp_group=None):
        super().__init__()
        self.config, self.layer_number, self.rng_tracker = config, layer_number, rng_tracker
        self.input_layernorm = build_norm(config, device=device)
        attention = MLASelfAttention if config.mla is not None else SelfAttention
        self.self_attention = attention(config, tp_group, rng_tracker, device, cp_group, layer_number)
        self.pre_mlp_layernorm = build_norm(config, device=device)
        if config.moe is not None and config.moe.is_moe_layer(layer_number, config.num_layers):
            self.mlp = MoELayer(config, tp_group, expert_state, device, cp_group)
            self.mlp.layer_number = layer_number  # names its logged auxiliary losses
        else:
            self.mlp = MLP(config, tp_group, device)

    def _dropout_add(self, x, residual):
        p = self.config.hidden_dropout if self.training else 0.0
        if p == 0:
            return residual + x
        # Under sequence parallelism each TP rank holds different tokens: draw per-rank masks.
        with rng_fork_if(self.rng_tracker, self.config.sequence_parallel):
            return residual + F.dropout(x, p, training=True)

    def forward(self, x, rotary=None, attention_mask=None, inference_cache=None):
        kv_cache = None if inference_cache is None else inference_cache.layer(self.layer_number)
        x = self._dropout_add(self.self_attention(self.input_layernorm(x), rotary, attention_mask, kv_cache), x)
        return self._dropout_add(self.mlp(self.pre_mlp_layernorm(x)), x)
