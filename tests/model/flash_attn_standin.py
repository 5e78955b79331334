"""A stand-in for the flash_attn package (which needs a GPU), installed in sys.modules.

Its flash_attn_func checks the arguments it gets (the [b, s, heads, d] layout, grouped k/v
heads, unit stride along d) and computes attention with plain torch ops and autograd,
honouring causal, softmax_scale, dropout_p and return_attn_probs (then returning the
log-sum-exp [b, heads, s_q] as flash_attn does). flash_attn.flash_attn_interface's
_flash_attn_backward writes into dq, dk, dv the gradients of attention given the output and
log-sum-exp it is handed, with the keyword arguments flash_attn `version` has after `causal`
(2.6.3 and later: window_size_left / window_size_right and softcap; before 2.6: window_size).
Each call is recorded in `calls`.
"""

import sys
import types

import torch

CURRENT, OLD = "2.7.4", "2.5.8"


def _expand(k, v, heads):
    repeat = heads // k.shape[2]  # query head i reads k/v head i // repeat
    return k.repeat_interleave(repeat, dim=2), v.repeat_interleave(repeat, dim=2)


def _scores(q, k, scale, causal):
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        assert sq == sk, "the stand-in handles causal attention of square blocks only"
        scores = scores.masked_fill(torch.ones(sq, sk, dtype=torch.bool, device=q.device).triu(1), float("-inf"))
    return scores


def _check_layout(q, k, v):
    assert q.dim() == k.dim() == v.dim() == 4 and k.shape == v.shape
    assert q.shape[0] == k.shape[0] and q.shape[3] == k.shape[3] and q.shape[2] % k.shape[2] == 0
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1, "flash_attn needs unit stride along d"


def make_flash_attn_func(calls):
    def flash_attn_func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, return_attn_probs=False,
                        **unused):
        """q [b, s, nq, d], k/v [b, s, nkv, d] -> [b, s, nq, d] (and lse, None)."""
        assert not unused, f"unexpected arguments {sorted(unused)}"
        _check_layout(q, k, v)
        calls.append(dict(kind="forward", q=tuple(q.shape), k=tuple(k.shape), dropout_p=dropout_p,
                          softmax_scale=softmax_scale, causal=causal, lse=return_attn_probs,
                          rng_state=torch.get_rng_state()))
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        k, v = _expand(k, v, q.shape[2])
        scores = _scores(q, k, scale, causal)
        out = torch.einsum("bhqk,bkhd->bqhd", torch.nn.functional.dropout(scores.softmax(-1), p=dropout_p), v)
        return (out, torch.logsumexp(scores, -1), None) if return_attn_probs else out
    return flash_attn_func


def _backward(calls, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, alibi_slopes,
              deterministic, rng_state):
    _check_layout(q, k, v)
    assert q.shape[-1] % 8 == 0, "flash_attn's backward takes head sizes padded to a multiple of 8"
    assert dout.shape == out.shape == q.shape and softmax_lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert dropout_p == 0.0 and alibi_slopes is None and rng_state is None and deterministic is False
    calls.append(dict(kind="backward", q=tuple(q.shape), k=tuple(k.shape), causal=causal))
    b, sk, hg, d = k.shape
    ke, ve = _expand(k, v, q.shape[2])
    p = torch.exp(_scores(q, ke, softmax_scale, causal) - softmax_lse.unsqueeze(-1))
    delta = (dout * out).sum(-1).transpose(1, 2)  # [b, h, sq]
    ds = p * (torch.einsum("bqhd,bkhd->bhqk", dout, ve) - delta.unsqueeze(-1))
    dq.copy_(torch.einsum("bhqk,bkhd->bqhd", ds, ke) * softmax_scale)
    dk.copy_((torch.einsum("bhqk,bqhd->bkhd", ds, q) * softmax_scale).view(b, sk, hg, -1, d).sum(3))
    dv.copy_(torch.einsum("bhqk,bqhd->bkhd", p, dout).view(b, sk, hg, -1, d).sum(3))
    return delta


def make_flash_attn_backward(calls, version):
    if version == CURRENT:
        def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                 window_size_left, window_size_right, softcap, alibi_slopes, deterministic,
                                 rng_state=None):
            assert (window_size_left, window_size_right, softcap) == (-1, -1, 0.0)
            return _backward(calls, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             alibi_slopes, deterministic, rng_state)
    else:
        def _flash_attn_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                                 window_size, alibi_slopes, deterministic, rng_state=None):
            assert tuple(window_size) == (-1, -1)
            return _backward(calls, dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal,
                             alibi_slopes, deterministic, rng_state)
    return _flash_attn_backward


def standin_modules(calls: list, version: str = CURRENT) -> dict:
    """{module name: module} of the stand-in flash_attn `version`, recording into `calls`."""
    package = types.ModuleType("flash_attn")
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    package.__version__ = version
    package.flash_attn_func = interface.flash_attn_func = make_flash_attn_func(calls)
    interface._flash_attn_backward = make_flash_attn_backward(calls, version)
    package.flash_attn_interface = interface
    return {"flash_attn": package, "flash_attn.flash_attn_interface": interface}


def install(calls: list, version: str = CURRENT) -> None:
    """Put the stand-in in sys.modules (in a spawned test process: it is the process's own)."""
    sys.modules.update(standin_modules(calls, version))
