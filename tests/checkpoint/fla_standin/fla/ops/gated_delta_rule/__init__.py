"""fla-core 0.6.0's chunk_gated_delta_rule API in plain torch (see fla/__init__.py): the arguments
the real one takes, checked as it checks them, computed token by token with
megalite.kernels.gated_delta.recurrent_gated_delta_rule (not the chunked form it is compared
against). Unknown keyword arguments are refused, so a misspelt one fails a test."""

import torch

from megalite.kernels.gated_delta import l2norm, recurrent_gated_delta_rule


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, cu_seqlens=None, chunk_size=64):
    if q.shape[2] != k.shape[2] or v.shape[2] % q.shape[2]:
        raise ValueError(f"q/k heads {q.shape[2]}/{k.shape[2]} must be equal and divide v's {v.shape[2]}")
    if chunk_size not in (16, 32, 64):
        raise ValueError(f"`chunk_size` must be 16, 32, or 64 for Gated Delta Rule, got {chunk_size}.")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if g.shape != v.shape[:3] or beta.shape != v.shape[:3]:
        raise ValueError(f"g {tuple(g.shape)} and beta {tuple(beta.shape)} must be v's [B, T, HV] {tuple(v.shape[:3])}")
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    groups = v.shape[2] // q.shape[2]  # value head j reads key head j // groups
    q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    if cu_seqlens is None:
        o, state = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=initial_state, scale=scale)
        return o, state if output_final_state else None
    if q.shape[0] != 1 or cu_seqlens.dtype != torch.long:
        raise ValueError(f"cu_seqlens (int64, got {cu_seqlens.dtype}) needs batch 1, got {q.shape[0]}")
    outs, states = [], []
    for i, (start, end) in enumerate(zip(cu_seqlens.tolist(), cu_seqlens[1:].tolist())):
        part = [t[:, start:end] for t in (q, k, v, g, beta)]
        o, state = recurrent_gated_delta_rule(*part, initial_state=None if initial_state is None else
                                              initial_state[i:i + 1], scale=scale)
        outs.append(o)
        states.append(state)
    return torch.cat(outs, dim=1), torch.cat(states) if output_final_state else None
