"""A pre-norm transformer layer: x + Attn(Norm(x)), then x + MLP(Norm(x)).

The output projections of attention and of a dense MLP hand their bias back (skip_bias_add) to
the layer's bias-dropout-add, residual + dropout(y + bias), one fused kernel on CUDA
(megalite.kernels.bias_dropout_add; --no-bias-dropout-fusion: the unfused torch ops)."""

import torch
from torch import nn

from megalite import kernels

from megalite.model.attention import SelfAttention
from megalite.model.gated_delta_net import GatedDeltaNet
from megalite.model.mla import MLASelfAttention
from megalite.model.mlp import MLP
from megalite.model.moe import MoELayer
from megalite.model.norms import build_norm
from megalite.model.offload import ActivationOffloader, parameters_of
from megalite.model.recompute import RecomputedOutput, checkpointed
from megalite.parallel.random import rng_fork_if


class TransformerLayer(nn.Module):
    def __init__(self, config, layer_number: int, tp_group=None, rng_tracker=None, device=None, expert_state=None,
                 cp_group=None):
        super().__init__()
        self.config, self.layer_number, self.rng_tracker = config, layer_number, rng_tracker
        self.input_layernorm = build_norm(config, device=device)
        self.is_linear = config.gdn is not None and config.gdn.is_linear_layer(layer_number, config.num_layers)
        attention = GatedDeltaNet if self.is_linear else MLASelfAttention if config.mla is not None else SelfAttention
        self.self_attention = attention(config, tp_group, rng_tracker, device, cp_group, layer_number)
        self.pre_mlp_layernorm = build_norm(config, device=device)
        if config.moe is not None and config.moe.is_moe_layer(layer_number, config.num_layers):
            self.mlp = MoELayer(config, tp_group, expert_state, device, cp_group)
            self.mlp.layer_number = layer_number  # names its logged auxiliary losses
        else:
            self.mlp = MLP(config, tp_group, device)
            self.mlp.linear_fc2.skip_bias_add = True
        if not self.is_linear:  # GatedDeltaNet's out_proj has no bias to hand over
            self.self_attention.linear_proj.skip_bias_add = True
        self.share_offloader(ActivationOffloader())

    def share_offloader(self, offloader: ActivationOffloader) -> None:
        """Offload through `offloader` (its model chunk's, --offload-modules) here and in the
        attention and experts."""
        self.offloader = self.self_attention.offloader = offloader
        if isinstance(self.mlp, MoELayer):
            self.mlp.local_experts.offloader = offloader

    def _dropout_add(self, out, residual):
        """residual + dropout(y + bias) of a module's output, (y, bias) or y."""
        y, bias = out if isinstance(out, tuple) else (out, None)
        p = self.config.hidden_dropout if self.training else 0.0
        impl = self.config.kernel_impl_for("bias_dropout_add")
        if p == 0:
            return kernels.bias_dropout_add(y, bias, residual, 0.0, impl=impl)
        # Under sequence parallelism each TP rank holds different tokens: draw per-rank masks.
        with rng_fork_if(self.rng_tracker, self.config.sequence_parallel):
            return kernels.bias_dropout_add(y, bias, residual, p, impl=impl)

    def forward(self, x, rotary=None, attention_mask=None, inference_cache=None):
        kv_cache = None
        if inference_cache is not None:
            kv_cache = (inference_cache.linear_layer if self.is_linear else inference_cache.layer)(self.layer_number)
        x = self._dropout_add(self._after_norm("attn_norm", self.input_layernorm, self.self_attention, x, rotary,
                                               attention_mask, kv_cache), x)
        return self._dropout_add(self._after_norm("mlp_norm", self.pre_mlp_layernorm, self._mlp, x), x)

    def _recomputes(self, module: str) -> bool:
        return self.config.recomputes(module) and self.training and torch.is_grad_enabled()

    def _after_norm(self, offload_name, norm, module, x, *args):
        """module(norm(x), *args); with --recompute-modules layernorm the norm's output is not kept
        for backward but recomputed from x (which the norm keeps anyway); with `offload_name` in
        --offload-modules what the norm keeps (x) is offloaded."""
        with self.offloader.region(offload_name, x, keep=parameters_of(norm)) as region:
            if not self._recomputes("layernorm"):
                h = norm(region.input)
            else:
                normed = RecomputedOutput(norm, region.input, store=region)
        if not self._recomputes("layernorm"):
            return module(h, *args)
        with normed.consumers() as h:
            return module(h, *args)

    def _mlp(self, h):
        """The MLP, or with --recompute-modules mlp (dense) / moe (MoE layer) recomputed in backward."""
        if self._recomputes("moe" if isinstance(self.mlp, MoELayer) else "mlp"):
            return checkpointed(self.mlp, None, h)  # no random draws inside
        return self.mlp(h)
