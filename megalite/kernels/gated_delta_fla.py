"""flash-linear-attention's chunked gated delta rule (fla-core 0.6, Triton) for Gated DeltaNet's
training forward and backward on CUDA; megalite.kernels.gated_delta's torch rule stays the CPU
path and the oracle.

fla's Triton kernels need CUDA (under TRITON_INTERPRET=1 on a CPU its chunk_gated_delta_rule
fails, 2026-11-28), so off CUDA the torch rule runs. On CUDA fla runs when
`fla.ops.gated_delta_rule` imports, the chunk size is one fla takes (16, 32, 64) and torch's
deterministic algorithms are off (--deterministic-mode: Megatron-Core's GatedDeltaNet also runs
its torch rule then). `choose_chunk_rule` says which, with the line a run prints at start-up.

The call (as Megatron-Core's gdn.py makes it): q, k, v [b, s, heads, d]; g the log decay (<= 0,
fp32); beta after the sigmoid; scale dk ** -0.5; q and k already l2-normalised
(use_qk_l2norm_in_kernel=False); no initial or final state; packed documents as cu_seqlens over
the rows laid end to end (batch 1). fla takes fewer key than value heads (value head j reads
key head j // (value heads / key heads), what repeat_interleave gives the torch rule), so q and
k go in unrepeated.
"""

import importlib

import torch

FLA_CHUNK_SIZES = (16, 32, 64)
INSTALL_HINT = "pip install fla-core==0.6.0 (with the installed torch) for flash-linear-attention's kernels"


def find_fla_chunk_rule(import_module=importlib.import_module):
    """fla's chunk_gated_delta_rule, or None when fla-core does not import."""
    try:
        return import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - ImportError, or a broken install (no triton) failing at import
        return None


def choose_chunk_rule(on_cuda: bool, chunk_size: int, fla_rule, deterministic: bool) -> tuple[str, str]:
    """("fla" or "torch", the start-up line saying which runs and why)."""
    torch_rule = "Gated DeltaNet: megalite's torch chunked delta rule"
    if not on_cuda:
        return "torch", f"{torch_rule} (not on CUDA)"
    if fla_rule is None:
        return "torch", f"{torch_rule}: flash-linear-attention is not installed; {INSTALL_HINT}"
    if deterministic:
        return "torch", f"{torch_rule} under --deterministic-mode (as Megatron-Core's)"
    if chunk_size not in FLA_CHUNK_SIZES:
        return "torch", f"{torch_rule}: chunk size {chunk_size} is not one fla takes {FLA_CHUNK_SIZES}"
    return "fla", "Gated DeltaNet: flash-linear-attention's chunk_gated_delta_rule (fla-core, Triton)"


def run_chunk_rule_line(gdn, device) -> str | None:
    """The start-up line for a run on `device` of a model with Gated DeltaNet config `gdn` (None:
    no GDN layers, no line). fla is imported only on CUDA."""
    if gdn is None:
        return None
    on_cuda = torch.device(device).type == "cuda"
    fla_rule = find_fla_chunk_rule() if on_cuda else None
    return choose_chunk_rule(on_cuda, gdn.chunk_size, fla_rule, torch.are_deterministic_algorithms_enabled())[1]


def fla_chunk_gated_delta_rule(fla_rule, q, k, v, g, beta, chunk_size: int, cu_seqlens=None) -> torch.Tensor:
    """q, k [b, s, key heads, dk] (l2-normalised), v [b, s, value heads, dv], g [b, s, value heads]
    (log decay), beta [b, s, value heads] in (0, 1), cu_seqlens (int64, [documents + 1], batch 1)
    -> o [b, s, value heads, dv] in v's dtype."""
    o, _ = fla_rule(q.to(v.dtype), k.to(v.dtype), v, g.float(), beta.to(v.dtype), scale=q.shape[-1] ** -0.5,
                    initial_state=None, output_final_state=False, use_qk_l2norm_in_kernel=False,
                    cu_seqlens=None if cu_seqlens is None else cu_seqlens.long(), chunk_size=chunk_size)
    return o.to(v.dtype)
