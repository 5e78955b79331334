"""Causal self-attention with grouped-query support, split over the TP group by heads.

The fused QKV projection is laid out per query group, as Megatron lays it out:
[q heads of group 0, k_0, v_0, q heads of group 1, k_1, v_1, ...], so a column-parallel split
gives each TP rank whole groups.
"""

import torch
from torch import nn

from megalite import kernels
from megalite.model.attention_backends import core_attention, pad_values
from megalite.model.norms import build_norm
from megalite.model.offload import ActivationOffloader, parameters_of
from megalite.model.recompute import checkpointed
from megalite.model.rope import apply_rotary_interleaved
from megalite.parallel import comm
from megalite.parallel.context import context_parallel_attention
from megalite.parallel.context.blocks import TorchBlocks
from megalite.parallel.context.flash_blocks import FlashBlocks, flash_attn_module
from megalite.parallel.context.dropout import AttentionDropout
from megalite.parallel.random import rng_fork_if
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


def _without_partial_views(qkv: torch.Tensor, *parts: torch.Tensor) -> tuple:
    """q, k, v as attention will save them for backward. Those still viewing the fused QKV
    projection's output are copied when the others are not (rotated, normalised or regrouped
    into new tensors): a saved view keeps that whole output alive, 3 s*b*h bytes per layer for
    Llama-3 8B where v alone is 0.5. When all three are views, the output is exactly q, k and v."""
    base = qkv if qkv._base is None else qkv._base
    views = [t._base is base for t in parts]
    if all(views):
        return parts
    return tuple(t.clone(memory_format=torch.contiguous_format) if view else t for t, view in zip(parts, views))


class SplitGroupedQKV(torch.autograd.Function):
    """q [s, b, groups * q_per_group, d], k and v [s, b, groups, d] of the fused projection's
    output viewed as [s, b, groups, q_per_group + 2, d], with one backward: the three gradients
    written once into a new tensor of that shape (torch.cat), where the slices' own backwards
    would each zero a tensor of the full shape, copy their part into it, and add the three."""

    @staticmethod
    def forward(ctx, qkv: torch.Tensor, q_per_group: int):
        s, b, groups, _, d = qkv.shape
        ctx.shape, ctx.q_per_group = qkv.shape, q_per_group
        q = qkv[:, :, :, :q_per_group].reshape(s, b, groups * q_per_group, d)
        return q, qkv[:, :, :, q_per_group], qkv[:, :, :, q_per_group + 1]

    @staticmethod
    def backward(ctx, dq, dk, dv):
        s, b, groups, _, d = ctx.shape
        grads = (dq, dk, dv)
        like = next(g for g in grads if g is not None)
        widths = (ctx.q_per_group, 1, 1)
        parts = [like.new_zeros(s, b, groups, n, d) if g is None else g.reshape(s, b, groups, n, d)
                 for g, n in zip(grads, widths)]  # (splitting a dim: a view, never a copy)
        return torch.cat(parts, dim=3), None


class SelfAttention(nn.Module):
    def __init__(self, config, tp_group=None, rng_tracker=None, device=None, cp_group=None, layer_number: int = 0):
        super().__init__()
        tp = comm.group_size(tp_group)
        self.config, self.rng_tracker, self.cp_group = config, rng_tracker, cp_group
        self.cp_comm_type = config.cp_comm_type_for(layer_number)
        self.head_dim = config.kv_channels
        self.heads = config.num_attention_heads // tp
        self.groups = config.num_query_groups // tp
        self.q_per_group = config.num_attention_heads // config.num_query_groups
        self.softmax_scale = config.softmax_scale if config.softmax_scale is not None else self.head_dim ** -0.5
        dtype = getattr(torch, config.params_dtype)
        # --attention-output-gate: each group's block is [q heads, their gate heads, k, v] (Megatron's)
        self.gated = config.attention_output_gate
        qkv_size = ((2 if self.gated else 1) * config.num_attention_heads + 2 * config.num_query_groups) * self.head_dim
        self.linear_qkv = ColumnParallelLinear(
            config.hidden_size, qkv_size, tp_group=tp_group, bias=config.add_bias_linear or config.add_qkv_bias,
            sequence_parallel=config.sequence_parallel, init_std=config.hidden_init_std,
            params_dtype=dtype, device=device)
        self.linear_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, tp_group=tp_group,
            bias=config.add_bias_linear, sequence_parallel=config.sequence_parallel,
            init_std=config.output_proj_init_std, params_dtype=dtype, device=device)
        self.q_layernorm = self.k_layernorm = None
        if config.qk_layernorm:
            # One norm over each head's channels, shared by every head; each TP rank sees only
            # its heads, so the weights' gradients are summed over the TP group.
            self.q_layernorm = build_norm(config, size=self.head_dim, partial_grad=True, device=device)
            self.k_layernorm = build_norm(config, size=self.head_dim, partial_grad=True, device=device)
        self.offloader = ActivationOffloader()  # its TransformerLayer's (--offload-modules)

    def core_attention(self, q, k, v, attention_mask):
        """q, k [s, b, nq or ng, d], v [s, b, ng, dv] -> context [s, b, nq*dv] (dv: d, or MLA's
        value width)."""
        s, b = q.shape[:2]
        dropout = self.config.attention_dropout if self.training else 0.0
        scale = self.softmax_scale
        if comm.group_size(self.cp_group) > 1:
            drop = None
            if dropout > 0:  # one seed per call from the model-parallel stream, equal on every CP rank
                with rng_fork_if(self.rng_tracker, True):
                    seed = int(torch.randint(0, 2 ** 31, (), device=q.device).item())
                drop = AttentionDropout(dropout, seed)
            # attention_mask: this rank's query rows of the whole sequence's mask [b, 1, s, s * cp]
            return context_parallel_attention(q, k, v, self.cp_group, self.cp_comm_type, scale,
                                              overlap=self.config.cp_ring_overlap, mask=attention_mask,
                                              dropout=drop, a2a_size=self.config.cp_a2a_size,
                                              blocks=FlashBlocks() if self.config.use_flash_attn else TorchBlocks)
        with rng_fork_if(self.rng_tracker, dropout > 0):
            if self.config.use_flash_attn and attention_mask is None:
                # flash_attn takes [b, s, heads, d] and grouped k/v heads as they are; it refuses
                # tensors off CUDA itself, and values narrower than the queries (MLA): padded.
                out = flash_attn_module().flash_attn_func(q.transpose(0, 1), k.transpose(0, 1),
                                                          pad_values(v, q.shape[-1]).transpose(0, 1),
                                                          dropout_p=dropout, softmax_scale=scale, causal=True)
                return out[..., :v.shape[-1]].transpose(0, 1).reshape(s, b, -1)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
            mask = None if attention_mask is None else ~attention_mask  # Megatron: True = masked out
            out = core_attention(q, k, v, mask, backend=self.config.attention_backend, dropout=dropout, scale=scale,
                                 softmax_in_fp32=self.config.attention_softmax_in_fp32)
        return out.permute(2, 0, 1, 3).reshape(s, b, -1)

    def _rotate(self, t, cos, sin):
        if self.config.rotary_interleaved:
            return apply_rotary_interleaved(t, cos, sin)
        return kernels.apply_rotary(t, cos, sin, impl=self.config.kernel_impl_for("rotary"))

    def forward(self, x, rotary=None, attention_mask=None, kv_cache=None):
        """`kv_cache` (inference only): one layer's megalite.inference.KVCache; the new keys
        and values are appended to it and the queries attend to every cached position."""
        with self.offloader.region("qkv_linear", x, keep=parameters_of(self)) as region:
            qkv, q, k, v, gate = self._query_key_value(region.input)
        if rotary is not None:
            q, k = self._rotate(q, *rotary), self._rotate(k, *rotary)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
            context = self.core_attention(q, k, v, kv_cache.attention_mask(q.shape[0], q.device))
            return self.linear_proj(self._gated(context, gate))
        q, k, v = _without_partial_views(qkv, q, k, v)
        if self.config.recomputes("core_attn"):
            # The tracker matters only when attention dropout draws from it (core_attention).
            forks = self.training and self.config.attention_dropout > 0
            context = checkpointed(self.core_attention, self.rng_tracker if forks else None, q, k, v, attention_mask)
        else:
            context = offloaded_core_attention(self, q, k, v, attention_mask)
        return offloaded_projection(self, self._gated(context, gate))

    def _query_key_value(self, x):
        """The fused projection's output and q, k, v (q and k normed with --qk-layernorm) and the
        output gate (None without --attention-output-gate), before rotation."""
        qkv = self.linear_qkv(x)
        s, b = qkv.shape[:2]
        gate = None
        if self.gated:
            qkv = qkv.view(s, b, self.groups, 2 * self.q_per_group + 2, self.head_dim)
            n = self.q_per_group
            q = qkv[:, :, :, :n].reshape(s, b, self.heads, self.head_dim)
            gate = qkv[:, :, :, n:2 * n].reshape(s, b, self.heads * self.head_dim)
            k, v = qkv[:, :, :, 2 * n], qkv[:, :, :, 2 * n + 1]
        else:
            qkv = qkv.view(s, b, self.groups, self.q_per_group + 2, self.head_dim)
            q, k, v = SplitGroupedQKV.apply(qkv, self.q_per_group)
        if self.q_layernorm is not None:
            q, k = self.q_layernorm(q), self.k_layernorm(k)
        return qkv, q, k, v, gate

    @staticmethod
    def _gated(context, gate):
        """context * sigmoid(gate) (fp32 sigmoid) with --attention-output-gate."""
        return context if gate is None else (context * torch.sigmoid(gate.float())).to(context.dtype)


def offloaded_core_attention(attention, q, k, v, attention_mask):
    """attention.core_attention with --offload-modules core_attn: what it saves (q, k, v, and the
    probabilities or softmax statistics of its backend) offloaded."""
    with attention.offloader.region("core_attn", q) as region:
        return attention.core_attention(region.input, k, v, attention_mask)


def offloaded_projection(attention, context):
    """attention.linear_proj with --offload-modules attn_proj: its saved input (the attention's
    output) offloaded."""
    with attention.offloader.region("attn_proj", context, keep=parameters_of(attention.linear_proj)) as region:
        return attention.linear_proj(region.input)
