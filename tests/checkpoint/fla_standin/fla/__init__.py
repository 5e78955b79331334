"""A stand-in for flash-linear-attention (fla-core), for tests/checkpoint/megatron_core_gdn_fixture.py
and tests/model/test_gdn_fla_path.py: megatron-core 0.16.1's GatedDeltaNet refuses to be built unless
`fla.modules.l2norm.l2norm` and `fla.ops.gated_delta_rule.chunk_gated_delta_rule` import. The
real fla-core 0.6.0 is Triton: under TRITON_INTERPRET=1 on this CPU its l2norm runs (equal to
x / sqrt(sum x^2 + 1e-6), 2.4e-7 from torch's normalize, 2026-11-28) but its
chunk_gated_delta_rule does not (the interpreter fails in chunk_delta_h.py: `i_t.to(tl.int64)`
on a Python int), and it needs einops, which the venv lacks. So this package supplies:
  - l2norm: the same formula in plain torch (megalite.kernels.gated_delta.l2norm);
  - chunk_gated_delta_rule: fla's arguments and checks, computed token by token in plain torch
    (megalite's recurrent rule), for megalite's argument mapping (test_gdn_fla_path.py); the
    checkpoint fixture runs Megatron-Core with deterministic_mode, where GatedDeltaNet computes
    the rule with Megatron's own torch_chunk_gated_delta_rule.
"""
