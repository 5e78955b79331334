"""--moe-router-load-balancing-type sinkhorn against Megatron-Core's own code on the same inputs:
moe_utils.sinkhorn, and TopKRouter.sinkhorn_load_balancing (training: top-k of the balanced
logits, probabilities the sigmoid / softmax scores; eval: top-k of the scores)."""

import types

import pytest
import torch

from megalite.model.moe_router import TopKRouter, sinkhorn, sinkhorn_routing
from tests.config.test_arguments import parsed, refused

megatron_moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")
megatron_router = pytest.importorskip("megatron.core.transformer.moe.router")


def skewed_logits(tokens=64, experts=8, seed=0):
    """Logits that favour expert 0, so that the balanced choice differs from the plain top-k."""
    logits = torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed))
    logits[:, 0] += 2.0
    return logits


@pytest.mark.parametrize("shape", [(64, 8), (30, 4), (7, 16)])
def test_sinkhorn_matches_megatron_core(shape):
    cost = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0]))
    torch.testing.assert_close(sinkhorn(cost), megatron_moe_utils.sinkhorn(cost.clone()), rtol=0, atol=0)
    balanced = sinkhorn(cost)
    torch.testing.assert_close(balanced.sum(1), torch.full((shape[0],), 1 / shape[0]), rtol=1e-3, atol=0)


def megatron_sinkhorn_routing(logits, topk, training):
    """Megatron's TopKRouter.sinkhorn_load_balancing, called on a stand-in router."""
    router = types.SimpleNamespace(topk=topk, training=training,
                                   config=types.SimpleNamespace(moe_aux_loss_coeff=0.0))
    return megatron_router.TopKRouter.sinkhorn_load_balancing(router, logits)


@pytest.mark.parametrize("topk", [1, 2])
@pytest.mark.parametrize("training", [True, False])
def test_sinkhorn_routing_matches_megatron_core(topk, training):
    logits = skewed_logits().requires_grad_()
    probs, routing_map = sinkhorn_routing(logits, topk, training)
    want_probs, want_map = megatron_sinkhorn_routing(logits, topk, training)
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs, want_probs, rtol=0, atol=0)
    grad = torch.randn_like(probs)
    got = torch.autograd.grad(probs, logits, grad)[0]
    torch.testing.assert_close(got, torch.autograd.grad(want_probs, logits, grad)[0], rtol=0, atol=0)
    plain_choice = logits.topk(topk, dim=1).indices
    balanced_differs = not torch.equal(routing_map, torch.zeros_like(routing_map).scatter(1, plain_choice, True))
    assert balanced_differs == training  # the balancing changes the choice only in training


def test_router_balances_each_sequence_parallel_rank_alone():
    """Megatron routes each sequence-parallel rank's rows alone: with two parts, the route is
    that of each half by itself."""
    moe = types.SimpleNamespace(num_experts=8, router_topk=1, load_balancing_type="sinkhorn", z_loss_coeff=None,
                                capacity_factor=None, aux_loss_coeff=0.0, enable_expert_bias=False, router_dtype=None)
    router = TopKRouter(16, moe, 0.02).train()
    logits = skewed_logits(32)
    probs, routing_map = router.route(logits, 16, 2, sequence_parts=2)
    halves = [megatron_sinkhorn_routing(half, 1, True) for half in logits.chunk(2)]
    assert torch.equal(routing_map, torch.cat([m for _, m in halves]))
    torch.testing.assert_close(probs, torch.cat([p for p, _ in halves]), rtol=0, atol=0)
    whole_map = router.route(logits, 16, 2)[1]
    assert torch.equal(whole_map, megatron_sinkhorn_routing(logits, 1, True)[1])
    assert not torch.equal(whole_map, routing_map)  # the parts' balancing is not the whole's


def test_sinkhorn_flags():
    args = parsed("--num-experts 4 --disable-bias-linear --moe-router-topk 1 "
                  "--moe-router-load-balancing-type sinkhorn", 1)
    assert args.moe_router_load_balancing_type == "sinkhorn"
    base = "--num-experts 4 --disable-bias-linear --moe-router-load-balancing-type sinkhorn "
    assert refused(base + "--moe-aux-loss-coeff 0.01") == (
        "--moe-router-load-balancing-type sinkhorn takes no --moe-aux-loss-coeff (got 0.01; Megatron asserts it is 0)")
    assert refused(base + "--moe-router-score-function sigmoid").startswith(
        "--moe-router-score-function has no effect with --moe-router-load-balancing-type sinkhorn")
    assert refused(base + "--moe-router-topk-scaling-factor 2").startswith("--moe-router-topk-scaling-factor has no")


def test_moe_layer_trains_its_router_through_the_sinkhorn_probabilities():
    from tests.model.test_moe import build

    layer = build(load_balancing_type="sinkhorn", router_topk=1).train()
    x = torch.randn(6, 3, 16, generator=torch.Generator().manual_seed(1))
    layer(x).square().sum().backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0
    logits = layer.router.gating(x.reshape(18, 16))
    counts = layer.last_tokens_per_expert
    assert sum(counts) == 18 and list(counts) == megatron_sinkhorn_routing(logits, 1, True)[1].sum(0).tolist()
