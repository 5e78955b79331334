"""Multi-latent attention (DeepSeek-V2/V3; Megatron-Core's MLASelfAttention), split over the TP
group by heads.

    q      = W_q_up norm(W_q_down x)                  (or W_q x without --q-lora-rank)
    c, k_r = W_kv_down x                              c: the kv latent, k_r: one rotary key
    k, v   = W_kv_up norm(c)                          per head: [k (qk_head_dim), v (v_head_dim)]
    q = [q_nope, rope(q_rope)], k = [k, rope(k_r) for every head]

The latent norms exist with --qk-layernorm, as in Megatron. The down projections are
replicated on every TP rank (Megatron's duplicated linears): under sequence parallelism they
see this rank's tokens only, their weight gradients are summed over the TP group like a norm's,
and the rotary key is gathered along the sequence. Rotary channels are taken even ones first,
then odd ones (Megatron's mla_rotary_interleaved) and rotated in the rotate-half layout.

Query/key heads are qk_head_dim + qk_pos_emb_head_dim wide, value heads v_head_dim: the
attention backends take the unequal widths (SDPA's math / memory-efficient / cuDNN kernels and
megalite's explicit path directly; SDPA's flash kernel and flash_attn with the values padded to
the query width, see attention_backends.pad_values).
"""

import torch
from torch import nn

from megalite import kernels
from megalite.model.attention import SelfAttention, offloaded_core_attention, offloaded_projection
from megalite.model.norms import build_norm
from megalite.model.offload import ActivationOffloader, parameters_of
from megalite.model.recompute import RecomputedOutput, checkpointed
from megalite.parallel import comm
from megalite.parallel.sharding import mark_sequence_parallel
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear


class ReplicatedLinear(nn.Module):
    """y = x W^T with W whole on every TP rank (no bias). `sequence_parallel`: the input is this
    rank's tokens, so W's gradient is partial and summed over the TP group."""

    def __init__(self, input_size, output_size, *, init_std, sequence_parallel, params_dtype, device):
        super().__init__()
        self.init_std = init_std
        self.weight = mark_sequence_parallel(
            nn.Parameter(torch.empty(output_size, input_size, dtype=params_dtype, device=device)), sequence_parallel)

    def reset_parameters(self, generator: torch.Generator) -> None:
        w = self.weight
        with torch.no_grad():
            w.copy_(torch.empty(w.shape, device=w.device).normal_(0.0, self.init_std, generator=generator))

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight)


def deinterleave(t: torch.Tensor, rotary_dim: int) -> torch.Tensor:
    """The first `rotary_dim` channels reordered even ones first, then odd ones; the rest kept."""
    rot = t[..., :rotary_dim]
    return torch.cat((rot[..., 0::2], rot[..., 1::2], t[..., rotary_dim:]), dim=-1)


class MLASelfAttention(nn.Module):
    """Multi-latent self-attention; input and output [s(/tp), b, h]."""

    core_attention = SelfAttention.core_attention  # the same backends, CP paths and dropout

    def __init__(self, config, tp_group=None, rng_tracker=None, device=None, cp_group=None, layer_number: int = 0):
        super().__init__()
        mla, tp = config.mla, comm.group_size(tp_group)
        self.config, self.mla, self.tp_group, self.rng_tracker, self.cp_group = config, mla, tp_group, rng_tracker, cp_group
        self.cp_comm_type = config.cp_comm_type_for(layer_number)
        self.heads = config.num_attention_heads // tp
        self.softmax_scale = mla.softmax_scale()
        heads, sp, std = config.num_attention_heads, config.sequence_parallel, config.hidden_init_std
        common = dict(params_dtype=getattr(torch, config.params_dtype), device=device)
        column = dict(tp_group=tp_group, bias=False, sequence_parallel=sp, init_std=std, **common)
        replicated = dict(init_std=std, sequence_parallel=sp, **common)
        latent_norm = config.qk_layernorm
        self.linear_q_proj = self.linear_q_down_proj = self.q_layernorm = self.linear_q_up_proj = None
        if mla.q_lora_rank is None:
            self.linear_q_proj = ColumnParallelLinear(config.hidden_size, heads * mla.q_head_dim, **column)
        else:
            self.linear_q_down_proj = ReplicatedLinear(config.hidden_size, mla.q_lora_rank, **replicated)
            if latent_norm:
                self.q_layernorm = build_norm(config, size=mla.q_lora_rank, device=device)
            self.linear_q_up_proj = ColumnParallelLinear(mla.q_lora_rank, heads * mla.q_head_dim, **column)
        self.linear_kv_down_proj = ReplicatedLinear(config.hidden_size, mla.kv_lora_rank + mla.qk_pos_emb_head_dim,
                                                    **replicated)
        self.kv_layernorm = build_norm(config, size=mla.kv_lora_rank, device=device) if latent_norm else None
        self.linear_kv_up_proj = ColumnParallelLinear(mla.kv_lora_rank, heads * (mla.qk_head_dim + mla.v_head_dim),
                                                      **column)
        self.linear_proj = RowParallelLinear(
            heads * mla.v_head_dim, config.hidden_size, tp_group=tp_group, bias=config.add_bias_linear,
            sequence_parallel=sp, init_std=config.output_proj_init_std, **common)
        self.offloader = ActivationOffloader()  # its TransformerLayer's (--offload-modules)

    def _rotate(self, t, cos, sin):
        return kernels.apply_rotary(deinterleave(t, cos.shape[-1]), cos, sin,
                                    impl=self.config.kernel_impl_for("rotary"))

    def _latents(self, x):
        """The down projections and latent norms: the queries' up-projection input (x itself
        without --q-lora-rank), the kv latent, and the rotary key of every position [s, b, 1, d]."""
        mla = self.mla
        q_in = x
        if self.linear_q_proj is None:
            q_in = self.linear_q_down_proj(x)
            if self.q_layernorm is not None:
                q_in = self.q_layernorm(q_in)
        latent, k_rope = self.linear_kv_down_proj(x).split([mla.kv_lora_rank, mla.qk_pos_emb_head_dim], dim=-1)
        if self.kv_layernorm is not None:
            latent = self.kv_layernorm(latent)
        # one rotary key for every head: each rank's heads give a partial gradient
        if self.config.sequence_parallel:
            k_rope = comm.gather_from_sequence_parallel_region(k_rope, self.tp_group)
        else:
            k_rope = comm.copy_to_tensor_parallel_region(k_rope, self.tp_group)
        return q_in, latent, k_rope.unsqueeze(2)

    def _up_proj_and_rope(self, q_in, latent, k_rope, cos=None, sin=None):
        """q, k [s, b, n/tp, qk_head_dim + qk_pos_emb_head_dim] and v [s, b, n/tp, v_head_dim]
        from _latents' results: the up projections and RoPE (Megatron's qkv_up_proj_and_rope_apply,
        what --recompute-modules mla_up_proj recomputes)."""
        mla = self.mla
        q = (self.linear_q_proj if self.linear_q_proj is not None else self.linear_q_up_proj)(q_in)
        s, b = q.shape[:2]
        q = q.view(s, b, self.heads, mla.q_head_dim)
        kv = self.linear_kv_up_proj(latent).view(s, b, self.heads, mla.qk_head_dim + mla.v_head_dim)
        k_nope, v = kv.split([mla.qk_head_dim, mla.v_head_dim], dim=-1)
        if cos is not None:
            q = torch.cat((q[..., :mla.qk_head_dim], self._rotate(q[..., mla.qk_head_dim:], cos, sin)), dim=-1)
            k_rope = self._rotate(k_rope, cos, sin)
        k = torch.cat((k_nope, k_rope.expand(-1, -1, self.heads, -1)), dim=-1)
        return q, k, v.contiguous()

    def query_key_value(self, x, rotary):
        """q, k [s, b, n/tp, qk_head_dim + qk_pos_emb_head_dim] and v [s, b, n/tp, v_head_dim]."""
        return self._up_proj_and_rope(*self._latents(x), *(rotary or ()))

    def _attention(self, q, k, v, attention_mask):
        if self.config.recomputes("core_attn"):
            forks = self.training and self.config.attention_dropout > 0
            return checkpointed(self.core_attention, self.rng_tracker if forks else None, q, k, v, attention_mask)
        return offloaded_core_attention(self, q, k, v, attention_mask)

    def forward(self, x, rotary=None, attention_mask=None, kv_cache=None):
        """As SelfAttention.forward; `rotary` is the MLA rotary part's (mla_config.mla_cos_sin).
        --offload-modules qkv_linear offloads what the down and up projections, latent norms and
        RoPE save (with mla_up_proj recomputed, the latents they are rebuilt from)."""
        keep = parameters_of(self) + list(rotary or ())
        if self.config.recomputes("mla_up_proj") and self.training and torch.is_grad_enabled():
            # q, k and v are not kept for the attention's backward but rebuilt from the latents
            with self.offloader.region("qkv_linear", x, keep=keep) as region:
                up = RecomputedOutput(self._up_proj_and_rope, *self._latents(region.input), *(rotary or ()),
                                      store=region)
            with up.consumers() as (q, k, v):
                context = self._attention(q, k, v, attention_mask)
            return offloaded_projection(self, context)
        with self.offloader.region("qkv_linear", x, keep=keep) as region:
            q, k, v = self.query_key_value(region.input, rotary)
        if kv_cache is not None:
            k, v = kv_cache.update(k, v)
            return self.linear_proj(self.core_attention(q, k, v, kv_cache.attention_mask(q.shape[0], q.device)))
        return offloaded_projection(self, self._attention(q, k, v, attention_mask))
