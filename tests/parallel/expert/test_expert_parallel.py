"""Expert parallelism against the single-process EP = 1 run (fp32, gloo, dropping off): the
tiny MoE GPT of ep_harness trained 2 Adam steps (clipping on) at DP = 4 with EP = 4 and EP = 2
(the latter with the distributed optimizer over the expert-data-parallel groups), TP = 2 with
sequence parallelism and EP = 2, and PP = 2 (1F1B) with EP = 2, for each token dispatcher: the
per-step losses, the first step's gradients, the final parameters and expert biases, and eval
logits all equal the reference within 1e-5 relative. One MoE layer at EP = 4 with a different
token count on each rank, capacity dropping on (pad and position policies) and off, equals the
EP = 1 layer on the same tokens (outputs, input, router and expert gradients). One spawn of 4
processes runs them all. An EP rank whose experts receive no token still joins the backward's
collectives (a spawn of 2, failing in 30 s should it wait in one). The same spawn checks
global_aux_loss's counts over DP = 4 against Megatron-Core (test_moe_global_aux_loss.py)."""

import math

import pytest

from tests.distributed import run_distributed
from tests.model.test_moe_global_aux_loss import assert_same, dp4_worker_losses, megatron_losses
from tests.parallel.expert.ep_harness import check_run, expert_state, layer_errors, train_runs

TOL = 1e-5
LAYOUTS = {
    "dp4-ep4": dict(ep=4),
    "dp4-ep2-distopt": dict(ep=2, dist_opt=True),
    "tp2-sp-dp2-ep2": dict(tp=2, ep=2, sp=True),
    "pp2-dp2-ep2": dict(pp=2, ep=2),
}
RUNS = [(layout, "alltoall", "softmax") for layout in LAYOUTS] + \
       [(layout, "allgather", "sigmoid") for layout in LAYOUTS] + \
       [("dp4-ep4", "alltoall", "sigmoid"), ("dp4-ep4", "allgather", "softmax")]


LAYER_CASES = {  # dropping on (each rank's capacity from its own tokens, as at EP = 1) and off
    "drop-probs-pad": dict(capacity_factor=0.75, pad_to_capacity=True),
    "drop-position": dict(capacity_factor=0.5, token_drop_policy="position"),
    "no-drop": {},
}


def _worker(rank, world_size):
    out = {}
    layer_state = expert_state(ep=4)
    for dispatcher in ("alltoall", "allgather"):
        for name, moe in LAYER_CASES.items():
            out[f"layer/{dispatcher}/{name}"] = layer_errors(layer_state, dispatcher, **moe)
    out["global_aux_loss"] = dp4_worker_losses(rank)
    return {**out, **train_runs(rank, world_size, LAYOUTS, RUNS)}


@pytest.fixture(scope="module")
def results():
    return run_distributed(_worker, 4, timeout=600)


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("case", list(LAYER_CASES))
def test_layer_at_ep4_with_variable_tokens_per_rank(results, dispatcher, case):
    """One MoE layer at EP = 4, 3 to 6 sequence positions per rank, against EP = 1."""
    for rank, r in enumerate(results):
        errors = dict(r[f"layer/{dispatcher}/{case}"])
        counts = errors.pop("counts")
        assert all(err <= TOL for err in errors.values()), (rank, errors)
        if case == "drop-probs-pad":  # every local expert gets its capacity in rows, from every rank
            assert counts == [sum(math.ceil((3 + q) * 2 * 2 / 8 * 0.75) for q in range(4))] * 2


def test_global_aux_loss_counts_over_the_data_parallel_group_as_megatron_core(results):
    """Each DP rank's global_aux_loss (counts of all 4 ranks, averaged over micro-batches) and its
    gradient equal Megatron-Core's _apply_global_aux_loss for that rank."""
    for rank, r in enumerate(results):
        assert_same(r["global_aux_loss"], megatron_losses(rank, 4))


@pytest.mark.parametrize("run", RUNS, ids=lambda r: "/".join(r))
def test_expert_parallel_equals_ep1(results, run, reference_runs):
    check_run(results, LAYOUTS, run, reference_runs)


def _starved_worker(rank, world_size):
    state = expert_state(ep=2)
    # Sigmoid routing with expert bias: the bias picks the experts, so no token picks 4 to 7 (EP rank 1's)
    steer = dict(score_function="sigmoid", enable_expert_bias=True, expert_bias=[0.0] * 4 + [-1e3] * 4)
    return {dispatcher: layer_errors(state, dispatcher, **steer) for dispatcher in ("alltoall", "allgather")}


def test_rank_whose_experts_get_no_tokens():
    """EP = 2: EP rank 1's experts receive no rows from either rank. Its backward still runs the
    dispatcher's collectives (it used to skip them, the other rank waiting there for good), its
    experts get zero gradients, and everything equals EP = 1."""
    for rank, r in enumerate(run_distributed(_starved_worker, 2, timeout=120, collective_timeout=30)):
        for dispatcher, errors in r.items():
            errors = dict(errors)
            counts = errors.pop("counts")
            assert (counts == [0] * 4) == (rank == 1), (rank, dispatcher, counts)
            assert all(err <= TOL for err in errors.values()), (rank, dispatcher, errors)
