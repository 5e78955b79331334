"""The gated delta rule (Gated DeltaNet, Yang et al. 2024) in plain torch: the CPU path and the
oracle. Per head, with a state S [dk, dv] and per token t a decay g_t <= 0 and a write strength
beta_t in (0, 1):

    S = exp(g_t) S
    u_t = beta_t (v_t - S^T k_t)          the delta: what the state mispredicts for k_t
    S = S + k_t u_t^T
    o_t = S^T q_t * scale                 scale = dk ** -0.5

`recurrent_gated_delta_rule` runs it token by token (generation, with a state carried between
calls). `chunk_gated_delta_rule` computes the same for training in chunks of C tokens: inside a
chunk, with gamma the cumulative decay from the chunk's start and S0 its initial state,

    (I + A) U = beta V - diag(beta exp(gamma)) K S0,   A_tj = beta_t exp(gamma_t - gamma_j) k_t.k_j (j < t)
    O = diag(exp(gamma)) Q S0 + (Q K^T * exp(gamma_t - gamma_j) [j <= t]) U
    S_C = exp(gamma_C) S0 + K^T diag(exp(gamma_C - gamma)) U

(a unit lower-triangular solve per chunk, in parallel over chunks; only the state passes from
chunk to chunk). A ragged last chunk is padded with beta = 0, g = 0 tokens, which neither write
nor decay. Documents packed in one sequence (`cu_seqlens`, as flash-linear-attention takes
them) each start from a zero state (or their row of `initial_state`).

Tensors are [batch, seq, heads, d] (q, k: dk; v: dv), g and beta [batch, seq, heads]; the
arithmetic is fp32 and outputs come back in v's dtype (the state in fp32).

On CUDA, where fla-core imports, Gated DeltaNet's training runs flash-linear-attention's Triton
kernel instead (megalite.kernels.gated_delta_fla); this rule is the CPU path and the oracle.
"""

import torch


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dim (the q/k normalisation of Gated DeltaNet)."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def _heads_first(*tensors):
    return [t.transpose(1, 2).float() for t in tensors]  # [b, h, s, ...]


def recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=None, scale=None):
    """Token-by-token gated delta rule. Returns (o [b, s, h, dv], final state [b, h, dk, dv])."""
    dtype, dk = v.dtype, q.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    b, h, s, dv = v.shape
    state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
    outs = []
    for t in range(s):
        state = state * g[:, :, t, None, None].exp()
        predicted = (k[:, :, t, :, None] * state).sum(-2)
        delta = (v[:, :, t] - predicted) * beta[:, :, t, None]
        state = state + k[:, :, t, :, None] * delta[:, :, None, :]
        outs.append((q[:, :, t, :, None] * state).sum(-2) * scale)
    return torch.stack(outs, dim=1).to(dtype), state


def _chunked(q, k, v, g, beta, state, chunk_size):
    """One sequence per batch row, heads first and fp32: q, k [b, h, s, dk] (q scaled), v
    [b, h, s, dv], g, beta [b, h, s], state [b, h, dk, dv]."""
    b, h, s, dk = k.shape
    pad = -s % chunk_size
    if pad:
        q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (torch.nn.functional.pad(t, (0, pad)) for t in (g, beta))
    n = (s + pad) // chunk_size
    q, k, v = (t.reshape(b, h, n, chunk_size, -1) for t in (q, k, v))
    g, beta = (t.reshape(b, h, n, chunk_size) for t in (g, beta))
    gamma = g.cumsum(-1)
    lower = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).tril()
    gap = gamma[..., :, None] - gamma[..., None, :]
    decay = gap.masked_fill(~lower, float("-inf")).exp()  # exp(gamma_t - gamma_j), j <= t
    strict = decay.tril(-1)
    a = beta[..., None] * strict * (k @ k.transpose(-1, -2))
    eye = torch.eye(chunk_size, device=q.device, dtype=q.dtype)
    solve = torch.linalg.solve_triangular(eye + a, eye.expand_as(a), upper=False, unitriangular=True)
    beta_v = solve @ (beta[..., None] * v)  # the part of U that does not depend on S0
    beta_k = solve @ ((beta * gamma.exp())[..., None] * k)  # U = beta_v - beta_k S0
    scores = (q @ k.transpose(-1, -2)) * decay
    q_decayed = q * gamma.exp()[..., None]
    k_to_end = k * (gamma[..., -1:] - gamma).exp()[..., None]
    outs = []
    for i in range(n):
        u = beta_v[:, :, i] - beta_k[:, :, i] @ state
        outs.append(q_decayed[:, :, i] @ state + scores[:, :, i] @ u)
        state = gamma[:, :, i, -1, None, None].exp() * state + k_to_end[:, :, i].transpose(-1, -2) @ u
    o = torch.stack(outs, dim=2).reshape(b, h, n * chunk_size, -1)[:, :, :s]
    return o, state


def chunk_gated_delta_rule(q, k, v, g, beta, chunk_size: int = 64, initial_state=None, cu_seqlens=None,
                           scale=None):
    """The gated delta rule computed chunk by chunk. Returns (o [b, s, h, dv], final states
    [b, h, dk, dv], or [documents, h, dk, dv] with `cu_seqlens`).

    `cu_seqlens` (int, [documents + 1], from 0 to s, batch 1): packed documents, each run from its
    own initial state (zero, or its row of `initial_state`)."""
    dtype, dk = v.dtype, q.shape[-1]
    scale = dk ** -0.5 if scale is None else scale
    if chunk_size < 1:
        raise ValueError(f"chunk_gated_delta_rule: chunk_size must be positive, got {chunk_size}")
    q, k, v, g, beta = _heads_first(q, k, v, g, beta)
    q = q * scale
    b, h, s, dv = v.shape
    if cu_seqlens is None:
        state = q.new_zeros(b, h, dk, dv) if initial_state is None else initial_state.float()
        o, state = _chunked(q, k, v, g, beta, state, chunk_size)
        return o.transpose(1, 2).to(dtype), state
    bounds = [int(x) for x in cu_seqlens]
    if b != 1 or bounds[0] != 0 or bounds[-1] != s or any(y <= x for x, y in zip(bounds, bounds[1:])):
        raise ValueError(f"chunk_gated_delta_rule: cu_seqlens {bounds} must rise strictly from 0 to the "
                         f"sequence length {s}, with batch 1 (got {b})")
    outs, states = [], []
    for i, (start, end) in enumerate(zip(bounds, bounds[1:])):
        state = q.new_zeros(1, h, dk, dv) if initial_state is None else initial_state[i:i + 1].float()
        part = slice(start, end)
        o, state = _chunked(q[:, :, part], k[:, :, part], v[:, :, part], g[:, :, part], beta[:, :, part], state,
                            chunk_size)
        outs.append(o)
        states.append(state)
    return torch.cat(outs, dim=2).transpose(1, 2).to(dtype), torch.cat(states)


def document_cu_seqlens(starts: torch.Tensor) -> torch.Tensor:
    """starts bool [b, s] (True where a document begins; column 0 is taken as True) ->
    cu_seqlens over the b rows laid end to end (each row also ends its documents)."""
    b, s = starts.shape
    starts = starts.clone()
    starts[:, 0] = True
    positions = torch.nonzero(starts.reshape(-1)).flatten()
    return torch.cat((positions, positions.new_tensor([b * s])))
