"""--moe-router-load-balancing-type global_aux_loss against Megatron-Core's own
TopKRouter._apply_global_aux_loss (megatron-core in the venv) on a stand-in router: the token counts
of every data- and context-parallel rank, averaged over the step's micro-batches so far, the loss
of this rank's scores, its gradient and its logged value. Megatron's reduction over its
tp_dp_cp group is an all-reduce; the stand-in gives it every rank's counts, which the test knows.
One process here; the same at DP = 4 inside tests/parallel/expert/test_expert_parallel.py's spawn
(global_aux_loss_worker)."""

import dataclasses
import types

import pytest
import torch

from megalite.model.moe import MoELayer, pop_logged_losses, reset_global_aux_loss_counts
from megalite.parallel import comm
from tests.config.test_arguments import parsed
from tests.model.moe_reference import tiny_config

S, B, E, TOPK, COEFF, MICRO_BATCHES = 4, 3, 8, 2, 0.01, 3


def global_layer(score_function: str = "softmax", group=None) -> MoELayer:
    """An MoE layer routed with global_aux_loss (its router counting over the DP x CP group `group`)."""
    layer = MoELayer(tiny_config(num_experts=E, router_topk=TOPK, score_function=score_function,
                                 load_balancing_type="global_aux_loss", aux_loss_coeff=COEFF))
    layer.router.dp_cp_group = group
    return layer.train()


def rank_logits(rank: int) -> list[torch.Tensor]:
    """Rank `rank`'s router logits of each micro-batch (rows in [seq, batch] order), skewed per rank."""
    g = torch.Generator().manual_seed(100 + rank)
    return [torch.randn(S * B, E, generator=g) + torch.linspace(0, rank, E) for _ in range(MICRO_BATCHES)]


def megalite_losses(rank: int, group=None, score_function: str = "softmax") -> dict:
    """megalite's router of `rank` (its DP x CP group `group`): each micro-batch's loss and its
    gradient in the logits, then the first micro-batch's loss again after the step's reset."""
    layer = global_layer(score_function, group)
    out = {"loss": [], "grad": []}
    for logits in rank_logits(rank):
        logits = logits.clone().requires_grad_()
        name, loss = layer.router._balancing_loss(logits, S, B)
        assert name == "global_load_balancing_loss"
        out["loss"].append(loss.detach())
        out["grad"].append(torch.autograd.grad(loss, logits)[0])
    reset_global_aux_loss_counts([layer])
    out["after_reset"] = layer.router._balancing_loss(rank_logits(rank)[0], S, B)[1].detach()
    return out


def dp4_worker_losses(rank: int) -> dict:
    """megalite_losses inside a spawn of 4 ranks at DP = 4 (test_expert_parallel.py's), with the
    group GPTModel gives its routers on that layout."""
    from megalite.model.gpt import GPTModel
    from megalite.model.moe import moe_layers
    from tests.parallel.expert.ep_harness import expert_state, moe_model_config

    pstate = expert_state(ep=4)
    model = GPTModel(moe_model_config("alltoall", "softmax", load_balancing_type="global_aux_loss"), pstate)
    (group,) = {layer.router.dp_cp_group for layer in moe_layers([model])}
    assert group is pstate.dp_cp_group and comm.group_size(group) == 4
    return megalite_losses(rank, group)


def megatron_losses(rank: int, ranks: int, score_function: str = "softmax") -> dict:
    """Megatron-Core's _apply_global_aux_loss of `rank` in a tp_dp_cp group of `ranks`."""
    router_module = pytest.importorskip("megatron.core.transformer.moe.router")
    moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
    every_rank = [rank_logits(r) for r in range(ranks)]
    attached = []
    router = types.SimpleNamespace(
        get_aux_loss_coeff=lambda kind: COEFF if kind == "global_aux_loss" else 0.0,
        tp_dp_cp_group=types.SimpleNamespace(size=lambda: ranks), topk=TOPK,
        global_tokens_per_expert=torch.zeros(E), ga_steps=torch.tensor(0.0),
        config=types.SimpleNamespace(num_moe_experts=E, moe_router_fusion=False),
        attach_and_log_load_balancing_loss=lambda probs, coeff, loss, name, group, **kw: attached.append(loss) or probs)
    out = {"loss": [], "grad": []}
    for step, logits in enumerate(every_rank[rank]):
        counts = sum(moe_utils.compute_routing_scores_for_aux_loss(mine[step], TOPK, score_function)[0].sum(0)
                     for mine in every_rank)
        with pytest.MonkeyPatch.context() as patch:  # the all-reduce over tp_dp_cp: every rank's counts
            patch.setattr(moe_utils, "reduce_from_tensor_model_parallel_region", lambda local, group: counts)
            logits = logits.clone().requires_grad_()
            routing_map, scores = moe_utils.compute_routing_scores_for_aux_loss(logits, TOPK, score_function)
            router_module.TopKRouter._apply_global_aux_loss(router, torch.zeros(S * B, E), scores, routing_map)
        out["loss"].append(attached[-1].detach())
        out["grad"].append(torch.autograd.grad(attached[-1], logits)[0])
    return out


def assert_same(got: dict, want: dict) -> None:
    for key in ("loss", "grad"):
        for step, (a, b) in enumerate(zip(got[key], want[key], strict=True)):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-12, msg=f"{key} of micro-batch {step}")
    torch.testing.assert_close(got["after_reset"], want["loss"][0], rtol=1e-6, atol=1e-12)


@pytest.mark.parametrize("score_function", ["softmax", "sigmoid"])
def test_global_aux_loss_equals_megatron_core(score_function):
    got = megalite_losses(0, score_function=score_function)
    assert_same(got, megatron_losses(0, 1, score_function))
    # past the first micro-batch the running average of the counts is not this micro-batch's (aux_loss)
    layer = global_layer(score_function)
    layer.router.moe = dataclasses.replace(layer.router.moe, load_balancing_type="aux_loss")
    assert not torch.allclose(got["loss"][2], layer.router._balancing_loss(rank_logits(0)[2], S, B)[1])


def test_global_aux_loss_is_logged_and_trains_the_router():
    """Through route(): the logged value is the loss over its coefficient (Megatron's
    global_load_balancing_loss) and the attached loss sends its gradient to the logits; in eval
    nothing is counted or logged."""
    layer = global_layer()
    logits = rank_logits(0)[0].requires_grad_()
    probs, _ = layer.router.route(logits, S, B)
    want = megatron_losses(0, 1)
    logged = pop_logged_losses([layer])
    assert logged["global_load_balancing_loss"][0] == pytest.approx(float(want["loss"][0]) / COEFF, rel=1e-6)
    (grad,) = torch.autograd.grad(probs.sum() * 0, logits)  # only the attached loss sends a gradient
    torch.testing.assert_close(grad, want["grad"][0], rtol=1e-6, atol=1e-12)
    layer.eval()
    layer.router.route(rank_logits(0)[1], S, B)
    assert layer.router.global_batches.item() == 1 and pop_logged_losses([layer]) == {}


def test_global_aux_loss_flag():
    from megalite.config.moe import moe_config_from_args

    args = parsed("--num-experts 4 --disable-bias-linear --moe-router-load-balancing-type global_aux_loss "
                  "--moe-aux-loss-coeff 0.01", 1)
    moe = moe_config_from_args(args, 64)
    assert (moe.load_balancing_type, moe.aux_loss_coeff) == ("global_aux_loss", 0.01)


def test_training_counts_each_step_afresh(monkeypatch):
    """In the training loop (one CPU process, 2 micro-batches a step): after each step the counts
    are those of that step's micro-batches alone, and the loss is logged under Megatron's name."""
    from megalite.config.arguments import parse_args
    from megalite.model.moe import moe_layers
    from megalite.parallel.state import ParallelState
    from megalite.training import setup_run
    from megalite.training.loop import Trainer
    from tests.training.launch import BASE, drop_flags

    monkeypatch.setattr(setup_run, "init_distributed", lambda parallel: (ParallelState.single(), torch.device("cpu")))
    extra = ["--num-layers", "1", "--hidden-size", "32", "--ffn-hidden-size", "48", "--seq-length", "16",
             "--global-batch-size", "4",
             "--train-iters", "2", "--lr-warmup-iters", "0", "--eval-iters", "0", "--num-experts", "4",
             "--moe-router-topk", "2",
             "--moe-router-load-balancing-type", "global_aux_loss", "--moe-aux-loss-coeff", "0.01"]
    run = setup_run.build_run(parse_args(drop_flags(BASE, *extra) + extra))
    trainer = Trainer(run)
    iterator = setup_run.data_iterator(run, trainer.train_ds, 0)
    routers = [layer.router for layer in moe_layers(run.models)]
    tokens_per_step = 2 * 2 * 16 * 2  # micro-batches x micro-batch x sequence x top-k
    for _ in range(2):
        trainer.train_step(iterator)
        for router in routers:
            assert router.global_batches.item() == 2
            assert router.global_tokens_per_expert.sum().item() == tokens_per_step
    logged = pop_logged_losses(run.models)
    assert set(logged) == {"global_load_balancing_loss"} and len(logged["global_load_balancing_loss"]) == 1
    trainer.close()
