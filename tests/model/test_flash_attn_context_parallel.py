"""--use-flash-attn with context parallelism, through the flash_attn stand-in
(flash_attn_standin.py, installed in each spawned rank).

Ring (p2p), all_gather and a2a+p2p attention run every block through flash_attn_func(...,
return_attn_probs=True) and merge the blocks by the log-sum-exp it returns; their backward
hands flash_attn's _flash_attn_backward each block with the merged output and log-sum-exp.
a2a runs flash_attn_func over the whole sequence of its heads. At CP = 4 (and CP = 2 with
TP = 2 and sequence parallelism), both families, every comm type: loss, logits and every
parameter's gradient equal the CP = 1 model through scaled_dot_product_attention within 1e-5
relative (fp32); also with a head size of 12 (padded to 16 for flash_attn's backward) and
with flash_attn 2.5's _flash_attn_backward arguments (window_size instead of
window_size_left / window_size_right and softcap)."""

import pytest

from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.model import flash_attn_standin
from tests.model.test_gpt_context_parallel import run_cp_model
from tests.model.test_gpt_tp import compare, make_config, run_model


def _check(calls, family, state, comm_type, **changes) -> list[str]:
    """Problems of one CP run against the single-process SDPA run (none: it matched and went
    through the stand-in, block log-sum-exps and backward included where the comm type has blocks)."""
    config = make_config(family, **changes)
    reference = run_model(config, ParallelState.single())
    what = f"{family} {comm_type} cp={state.cp_size} tp={state.tp_size} {changes}"
    calls.clear()
    try:
        compare(run_cp_model(config.replace(use_flash_attn=True, cp_comm_type=comm_type,
                                            sequence_parallel=state.tp_size > 1,
                                            cp_a2a_size=2 if comm_type == "a2a+p2p" else 1), state),
                reference, what)
    except AssertionError as e:
        return [str(e)]
    kinds = [(c["kind"], c.get("lse")) for c in calls]
    blocks = comm_type != "a2a"
    expected = {("forward", True), ("backward", None)} if blocks else {("forward", False)}
    if set(kinds) != expected:
        return [f"{what}: flash_attn calls {sorted(set(kinds), key=str)}, expected {sorted(expected, key=str)}"]
    return []


def _worker(rank, world_size):
    calls = []
    flash_attn_standin.install(calls)
    cp4 = ParallelState.create(ParallelLayout(world_size, context=4))
    cp2tp2 = ParallelState.create(ParallelLayout(world_size, tensor=2, context=2))
    failures = []
    for family in ("gpt2", "llama"):
        for comm_type in ("p2p", "all_gather", "a2a", "a2a+p2p"):
            failures += _check(calls, family, cp4, comm_type)
        for comm_type in ("p2p", "all_gather", "a2a"):
            failures += _check(calls, family, cp2tp2, comm_type)
    failures += _check(calls, "llama", cp4, "p2p", kv_channels=12)
    flash_attn_standin.install(calls, flash_attn_standin.OLD)
    failures += _check(calls, "gpt2", cp4, "all_gather")
    return failures


def test_flash_attn_context_parallel_matches_cp1_sdpa():
    for failures in run_distributed(_worker, 4):
        assert not failures, failures
