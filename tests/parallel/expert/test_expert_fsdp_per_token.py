"""Mixtures of experts with FSDP2 and with --calculate-per-token-loss, against the
single-process run (fp32, gloo, dropping off), each token dispatcher and both routers of
ep_harness.

FSDP2 (--use-torch-fsdp2): the local experts sharded over their own expert-data-parallel mesh
(EDP = 2 at DP = 4, EP = 2 and at TP = 2, ETP = 1, EP = 2; a mesh of one rank at EP = 4), the
rest over DP; losses, first-step gradients, final parameters and logits equal the EP = 1,
non-FSDP run within 1e-5 relative.

Per-token loss: Megatron weights each auxiliary loss by its micro-batch's routed tokens when
the step's gradient is divided by the global batch's loss tokens. With every token in the loss
and equal micro-batches that is exactly the default mode's 1 / (micro-batches x DP), which the
single-process runs check; with masked tokens the EP = 2 (also at TP = 2, ETP = 1, and at CP =
2) run equals the single-process per-token run."""

import pytest
import torch

from tests.distributed import run_distributed
from tests.numerics import rel_error
from tests.parallel.expert.ep_harness import check_run, moe_model_config, reference, train_runs

TOL = 1e-5
LAYOUTS = {
    "dp4-ep2-fsdp": dict(ep=2, fsdp=True),
    "dp4-ep4-fsdp": dict(ep=4, fsdp=True),
    "tp2-sp-etp1-ep2-fsdp": dict(tp=2, ep=2, etp=1, sp=True, fsdp=True),
    "dp4-ep2-per-token": dict(ep=2, per_token=True),
    "tp2-sp-etp1-ep2-per-token": dict(tp=2, ep=2, etp=1, sp=True, per_token=True),
    "cp2-ep2-per-token": dict(cp=2, ep=2, per_token=True),
}
RUNS = [("dp4-ep2-fsdp", "alltoall", "softmax"), ("dp4-ep2-fsdp", "allgather", "sigmoid"),
        ("dp4-ep4-fsdp", "alltoall", "sigmoid"), ("tp2-sp-etp1-ep2-fsdp", "allgather", "softmax"),
        ("dp4-ep2-per-token", "alltoall", "softmax"), ("dp4-ep2-per-token", "allgather", "sigmoid"),
        ("tp2-sp-etp1-ep2-per-token", "alltoall", "sigmoid"), ("cp2-ep2-per-token", "allgather", "softmax")]


@pytest.fixture(scope="module")
def results():
    return run_distributed(train_runs, 4, LAYOUTS, RUNS, timeout=900)


@pytest.mark.parametrize("run", RUNS, ids=lambda r: "/".join(r))
def test_fsdp_and_per_token_loss_equal_single_process(results, run, reference_runs):
    check_run(results, LAYOUTS, run, reference_runs)


@pytest.mark.parametrize("router", ["softmax", "sigmoid"])
def test_per_token_loss_with_every_token_counted_is_the_default_mode(router):
    config = moe_model_config("alltoall", router)
    per_token, default = reference(config, per_token=True, full_masks=True), reference(config, full_masks=True)
    assert rel_error(torch.tensor(per_token["losses"]), torch.tensor(default["losses"])) <= TOL
    for key in ("grads", "params"):
        for name, value in default[key].items():
            assert rel_error(per_token[key][name], value) <= TOL, (key, name)
    # the auxiliary losses matter here: without them the router's gradient differs
    unweighted = reference(config.replace(moe=config.moe.__class__(**{**config.moe.to_dict(), "aux_loss_coeff": 0.0,
                                                                       "z_loss_coeff": None})),
                           per_token=True, full_masks=True)
    assert rel_error(unweighted["grads"]["layers.0.mlp.router.weight"],
                     default["grads"]["layers.0.mlp.router.weight"]) > 1e-3

