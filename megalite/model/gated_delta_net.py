"""Gated DeltaNet linear attention (Qwen3-Next; Megatron-Core's GatedDeltaNet), split over the TP
group by heads. Input and output [s(/tp), b, h]:

    q, k, v, z, b, a = in_proj(x)                    Megatron's layout, see GDNConfig.in_proj_sections
    q, k, v = act(causal depthwise conv(q, k, v))    --linear-conv-kernel-dim taps, no bias
    q, k = l2norm(q), l2norm(k)                      (each key head repeated for its value heads)
    g = -exp(A_log) softplus(a + dt_bias),  beta = sigmoid(b)
    o = gated delta rule(q, k, v, g, beta)           megalite.kernels.gated_delta
    out_proj(norm(o) * act(z))                       norm: the model's kind over each value head

`act` is the model's activation function as Megatron's config.activation_func (silu with
--swiglu). Each of in_proj's six blocks, the convolution's three channel blocks, A_log and
dt_bias are split over the TP ranks on their own (column-parallel in_proj, row-parallel
out_proj), so a rank holds whole key heads and their value heads. out_norm is one norm shared by
every head: its gradient is partial per rank and summed over the TP group.

Under context parallelism (as Megatron-Core's GatedDeltaNet) the whole of in_proj's output
goes through one all-to-all after the projection (megalite.parallel.context.channels): each CP
rank then holds the whole sequence, in order, for 1/cp of the heads of every block (q, k, v,
z, beta, alpha), convolves and runs the recurrence with its slices of conv1d, A_log and dt_bias,
normalises and gates, and a second all-to-all returns its load-balanced chunks of every head
before out_proj. The parameters stay whole on every CP rank; each receives the gradient of its
slices, summed over the CP group with the others'. Key heads must divide by TP x CP.

Documents packed in a row (an `attention_mask` from --reset-attention-mask) reset the
convolution and the state at each document start, as Megatron does with packed sequences
(under CP the document starts of the whole sequence are gathered from every rank's mask rows).
Generation carries the convolution's last inputs and the state in a
megalite.inference.kv_cache.LinearAttentionState.

Training's chunked rule is flash-linear-attention's Triton kernel on CUDA where fla-core
imports, else megalite's torch rule (megalite.kernels.gated_delta_fla.choose_chunk_rule);
generation's token-by-token rule is always torch's.
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

from megalite.kernels.gated_delta import chunk_gated_delta_rule, document_cu_seqlens, l2norm, recurrent_gated_delta_rule
from megalite.kernels.dispatch import on_real_cuda
from megalite.kernels.gated_delta_fla import choose_chunk_rule, find_fla_chunk_rule, fla_chunk_gated_delta_rule
from megalite.model.norms import build_norm
from megalite.parallel import comm
from megalite.parallel.context import gather_sequence, local_positions
from megalite.parallel.context.channels import channels_to_sequence, sequence_to_channels
from megalite.parallel.sharding import mark_sharded, shard_of_full
from megalite.parallel.tensor.layers import ColumnParallelLinear, RowParallelLinear

A_INIT_RANGE = (1.0, 16.0)
"""A = exp(A_log) is drawn uniformly from this range (Megatron's A_init_range)."""


def activation_function(name: str):
    """Megatron's config.activation_func for megalite's activation names."""
    return {"swiglu": F.silu, "gelu": F.gelu, "openai_gelu": lambda x: F.gelu(x, approximate="tanh"),
            "squared_relu": lambda x: F.relu(x).square()}[name]


def document_starts(attention_mask: torch.Tensor | None, batch: int, seq_len: int,
                    cp_group=None) -> torch.Tensor | None:
    """bool [b, seq_len], True where a token cannot see the token before it (a document start)
    under a Megatron mask [b or 1, 1, rows, seq_len] (True = not allowed); None when no token
    after the first starts one. Under context parallelism the rows are this CP rank's tokens
    (split.split_attention_mask) and the starts of the whole sequence are gathered."""
    if attention_mask is None or seq_len < 2:
        return None
    cp, device = comm.group_size(cp_group), attention_mask.device
    rows = torch.arange(attention_mask.shape[2], device=device)
    positions = local_positions(seq_len, cp, comm.group_rank(cp_group), device) if cp > 1 else rows
    starts = attention_mask[:, 0, rows, (positions - 1).clamp(min=0)].expand(batch, -1) | (positions == 0)
    if cp > 1:  # (gloo gathers no bool)
        starts = gather_sequence(starts.to(torch.uint8), 1, cp_group).bool()
    if not bool(starts[:, 1:].any()):
        return None
    return starts


def _tp_param(shape, dim_sections, tp, dtype, device):
    local = list(shape)
    local[0] //= tp
    return mark_sharded(nn.Parameter(torch.empty(local, dtype=dtype, device=device)), 0, dim_sections)


class GatedDeltaNet(nn.Module):
    def __init__(self, config, tp_group=None, rng_tracker=None, device=None, cp_group=None, layer_number: int = 0):
        super().__init__()
        gdn, tp = config.gdn, comm.group_size(tp_group)
        if gdn.linear_num_key_heads % tp or gdn.linear_num_value_heads % tp:
            raise ValueError(f"Gated DeltaNet: --linear-num-key-heads {gdn.linear_num_key_heads} and "
                             f"--linear-num-value-heads {gdn.linear_num_value_heads} must be divisible by the "
                             f"tensor-parallel size {tp}")
        cp = comm.group_size(cp_group)
        if gdn.linear_num_key_heads % (tp * cp):
            raise ValueError(f"Gated DeltaNet: --linear-num-key-heads {gdn.linear_num_key_heads} must be divisible by "
                             f"--tensor-model-parallel-size {tp} x --context-parallel-size {cp}")
        self.config, self.gdn, self.tp, self.tp_group, self.cp, self.cp_group = config, gdn, tp, tp_group, cp, cp_group
        self.act = activation_function(config.activation)
        # the heads this rank computes: its TP share, split again over the CP ranks
        self.key_heads = gdn.linear_num_key_heads // (tp * cp)
        self.value_heads = gdn.linear_num_value_heads // (tp * cp)
        dtype = getattr(torch, config.params_dtype)
        sp = config.sequence_parallel
        sections = gdn.in_proj_sections()
        self.in_proj = ColumnParallelLinear(config.hidden_size, sum(sections), tp_group=tp_group, bias=False,
                                            sequence_parallel=sp, init_std=config.hidden_init_std,
                                            params_dtype=dtype, device=device)
        self.in_proj.weight.partition_stride = sections
        self.conv_sections = (gdn.qk_dim, gdn.qk_dim, gdn.v_dim)
        kernel = gdn.linear_conv_kernel_dim
        self.conv1d = nn.Module()  # Megatron's nn.Conv1d(groups=channels, bias=False): its weight only
        self.conv1d.weight = _tp_param((sum(self.conv_sections), 1, kernel), self.conv_sections, tp, dtype, device)
        nv = gdn.linear_num_value_heads
        self.dt_bias = _tp_param((nv,), 1, tp, dtype, device)
        self.A_log = _tp_param((nv,), 1, tp, dtype, device)
        self.out_norm = build_norm(config, size=gdn.linear_value_head_dim, partial_grad=True, device=device)
        self.out_proj = RowParallelLinear(gdn.v_dim, config.hidden_size, tp_group=tp_group, bias=False,
                                          sequence_parallel=sp, init_std=config.output_proj_init_std,
                                          params_dtype=dtype, device=device)
        self.fla_rule, self.fla_looked_up = None, False  # fla's chunk_gated_delta_rule, looked up on CUDA

    def reset_parameters(self, generator: torch.Generator) -> None:
        """The full conv1d weight (nn.Conv1d's default: uniform within 1 / sqrt(kernel)), A_log
        and dt_bias drawn or set whole, then sliced to this rank (in_proj, out_proj and out_norm
        initialise themselves)."""
        rank = comm.group_rank(self.tp_group) if self.tp > 1 else 0
        w = self.conv1d.weight
        bound = 1.0 / math.sqrt(self.gdn.linear_conv_kernel_dim)
        full_conv = torch.empty((w.shape[0] * self.tp, *w.shape[1:]), device=w.device).uniform_(
            -bound, bound, generator=generator)
        full_a = torch.empty(self.gdn.linear_num_value_heads, device=w.device).uniform_(*A_INIT_RANGE,
                                                                                         generator=generator)
        with torch.no_grad():
            w.copy_(shard_of_full(full_conv, 0, self.conv_sections, rank, self.tp))
            self.A_log.copy_(shard_of_full(full_a.log(), 0, 1, rank, self.tp))
            self.dt_bias.fill_(1.0)

    def _convolve(self, qkv, starts, state):
        """Causal depthwise convolution of qkv [b, s, c] then the activation; taps that reach into
        an earlier document (starts) read zeros. `state` (generation) supplies the inputs before
        this call's first token and keeps the last kernel-1."""
        b, s, c = qkv.shape
        weight = self._cp_slice(self.conv1d.weight, [size // self.tp for size in self.conv_sections])[:, 0]
        kernel = weight.shape[1]
        history = qkv.new_zeros(b, kernel - 1, c)
        if state is not None:
            if state.conv is not None:
                history = state.conv.transpose(1, 2).to(qkv.dtype)
            state.conv = torch.cat((history, qkv), dim=1)[:, -(kernel - 1):].transpose(1, 2).detach() \
                if kernel > 1 else qkv.new_zeros(b, c, 0)
        padded = torch.cat((history, qkv), dim=1)  # [b, kernel - 1 + s, c]
        document = None if starts is None else starts.long().cumsum(1)
        out = qkv * weight[:, -1]
        for back in range(1, kernel):
            tap = padded[:, kernel - 1 - back:kernel - 1 - back + s] * weight[:, -1 - back]
            if document is not None:  # the tap reads token t - back: zero unless in t's document
                same = torch.zeros_like(document, dtype=torch.bool)
                same[:, back:] = document[:, back:] == document[:, :-back]
                tap = tap * same.unsqueeze(-1)
            out = out + tap
        return self.act(out)

    def _cp_slice(self, param, sections):
        """This CP rank's part of each block of `param` (whole on every CP rank) along dim 0: the
        weights of the heads it computes (Megatron's get_parameter_local_cp)."""
        if self.cp == 1:
            return param
        return shard_of_full(param, 0, tuple(sections), comm.group_rank(self.cp_group), self.cp)

    def forward(self, x, rotary=None, attention_mask=None, kv_cache=None):
        """`kv_cache` (generation): this layer's LinearAttentionState, read and updated."""
        gdn = self.gdn
        if kv_cache is not None and self.cp > 1:
            raise ValueError("Gated DeltaNet generation (a state cache) does not run under context parallelism")
        projected = self.in_proj(x)  # [s / cp, b, in_proj_dim / tp]
        tp_sections = tuple(size // self.tp for size in gdn.in_proj_sections())
        projected = sequence_to_channels(projected, tp_sections, self.cp_group).transpose(0, 1)  # [b, s, . / cp]
        b, s = projected.shape[:2]
        local = [size // self.cp for size in tp_sections]
        qkv, z, beta, alpha = projected.split([sum(local[:3]), local[3], local[4], local[5]], dim=-1)
        starts = document_starts(attention_mask, b, s, self.cp_group) if kv_cache is None else None
        qkv = self._convolve(qkv, starts, kv_cache)
        q, k, v = qkv.split(local[:3], dim=-1)
        q = l2norm(q.reshape(b, s, self.key_heads, gdn.linear_key_head_dim))
        k = l2norm(k.reshape(b, s, self.key_heads, gdn.linear_key_head_dim))
        v = v.reshape(b, s, self.value_heads, gdn.linear_value_head_dim)
        a_log, dt_bias = (self._cp_slice(p, [p.shape[0]]) for p in (self.A_log, self.dt_bias))
        g = -a_log.float().exp() * F.softplus(alpha.float() + dt_bias.float())
        beta = beta.sigmoid()
        cu_seqlens = None if starts is None else document_cu_seqlens(starts)
        if kv_cache is None and self._chunk_rule(on_real_cuda(v)) == "fla":  # fla repeats the key heads itself
            o = self._rows_end_to_end(lambda *t: fla_chunk_gated_delta_rule(
                self.fla_rule, *t, chunk_size=gdn.chunk_size, cu_seqlens=cu_seqlens), q, k, v, g, beta, cu_seqlens)
        else:
            if self.value_heads != self.key_heads:
                q = q.repeat_interleave(self.value_heads // self.key_heads, dim=2)
                k = k.repeat_interleave(self.value_heads // self.key_heads, dim=2)
            if kv_cache is not None:
                o, kv_cache.recurrent = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=kv_cache.recurrent)
            else:
                o = self._rows_end_to_end(lambda *t: chunk_gated_delta_rule(
                    *t, chunk_size=gdn.chunk_size, cu_seqlens=cu_seqlens)[0], q, k, v, g, beta, cu_seqlens)
        normed = self.out_norm(o) * self.act(z.reshape(b, s, self.value_heads, -1).float())
        normed = normed.to(x.dtype).reshape(b, s, -1).transpose(0, 1)
        return self.out_proj(channels_to_sequence(normed, (gdn.v_dim // self.tp,), self.cp_group))

    def _chunk_rule(self, on_cuda: bool) -> str:
        """"fla" or "torch" for this training forward (choose_chunk_rule; fla imported once)."""
        if not on_cuda:
            return "torch"
        if not self.fla_looked_up:
            self.fla_rule, self.fla_looked_up = find_fla_chunk_rule(), True
        return choose_chunk_rule(on_cuda, self.gdn.chunk_size, self.fla_rule,
                                 torch.are_deterministic_algorithms_enabled())[0]

    @staticmethod
    def _rows_end_to_end(rule, q, k, v, g, beta, cu_seqlens):
        """rule(q, k, v, g, beta) -> o on the rows as they are, or (packed documents: cu_seqlens)
        on the rows laid end to end, a state reset at each document."""
        if cu_seqlens is None:
            return rule(q, k, v, g, beta)
        b, s = v.shape[:2]
        o = rule(*(t.reshape(1, b * s, *t.shape[2:]) for t in (q, k, v, g, beta)))
        return o.reshape(b, s, *o.shape[2:])
