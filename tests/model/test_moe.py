"""MoE layer at EP = 1 against the plain-loop reference (tests/model/moe_reference.py): routing
variants, capacity dropping, shared experts; auxiliary and z-losses against their formulas;
expert bias moving a skewed router toward balance."""

import math

import pytest
import torch

from megalite.model.moe import MoELayer, pop_logged_losses, update_expert_bias
from megalite.model.moe_config import parse_layer_freq
from megalite.model.moe_router import AttachLoss
from tests.model.moe_reference import reference_moe, tiny_config


def build(seed=0, **kw):
    config = tiny_config(**kw)
    layer = MoELayer(config)
    gen = torch.Generator().manual_seed(seed)
    for module in layer.modules():
        if hasattr(module, "reset_parameters") and module is not layer:
            module.reset_parameters(gen)
    return layer


VARIANTS = [
    {},
    {"pre_softmax": True, "router_topk": 3},
    {"score_function": "sigmoid", "topk_scaling_factor": 2.5},
    {"num_groups": 4, "group_topk": 2},
    {"score_function": "sigmoid", "router_topk": 1},
    {"capacity_factor": 0.5},
    {"capacity_factor": 0.75, "token_drop_policy": "position"},
    {"capacity_factor": 0.5, "pad_to_capacity": True},
    {"shared_expert_intermediate_size": 20, "shared_expert_gate": True},
    {"activation": "gelu", "router_dtype": "fp64", "grouped_gemm": True},
]


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: ",".join(f"{k}={w}" for k, w in v.items()) or "default")
def test_layer_matches_plain_loop(variant):
    layer = build(**variant)
    x = torch.randn(6, 3, 16, generator=torch.Generator().manual_seed(1), requires_grad=True)
    out = layer(x)
    grad = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, *layer.parameters()], grad)
    x_ref = x.detach().clone().requires_grad_()
    ref, kept = reference_moe(layer, x_ref)
    want = torch.autograd.grad(ref, [x_ref, *layer.parameters()], grad, allow_unused=True)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, torch.zeros_like(g) if w is None else w, rtol=1e-5, atol=1e-6)
    moe = layer.moe
    counts = layer.last_tokens_per_expert
    if moe.capacity_factor is not None:
        capacity = math.ceil(18 * moe.router_topk / moe.num_experts * moe.capacity_factor)
        if moe.pad_to_capacity:
            assert counts == [capacity] * moe.num_experts
        else:
            assert max(counts) <= capacity and sum(counts) == len(kept) < 18 * moe.router_topk
    else:
        assert sum(counts) == len(kept) == 18 * moe.router_topk
        per_expert = [sum(1 for _, e in kept if e == i) for i in range(moe.num_experts)]
        assert counts == per_expert


def test_dropped_tokens_are_the_capacity_rule():
    """The (token, expert) pairs that reach the experts are exactly those the rule keeps."""
    for policy in ("probs", "position"):
        layer = build(capacity_factor=0.5, token_drop_policy=policy)
        x = torch.randn(8, 2, 16, generator=torch.Generator().manual_seed(3))
        tokens = x.reshape(16, 16)
        probs, routing_map = layer.router(tokens, 8, 2)
        _, kept = reference_moe(layer, x)
        got = {(t, e) for t, e in routing_map.nonzero().tolist()}
        assert got == kept and len(kept) < 32
        assert torch.all((probs > 0) == routing_map)


def _loss_grad(layer, x, coeffs):
    layer.zero_grad()
    layer.train()
    out = layer(x)
    out.square().sum().backward()
    return layer.router.weight.grad.clone()


@pytest.mark.parametrize("kind", ["aux_loss", "seq_aux_loss", "z_loss"])
def test_router_losses_match_direct_computation(kind):
    s, b, E, k, coeff = 6, 3, 8, 2, 0.1
    base = {"z_loss": {"z_loss_coeff": coeff}}.get(kind, {"load_balancing_type": kind, "aux_loss_coeff": coeff})
    layer = build(**base, score_function="sigmoid" if kind == "seq_aux_loss" else "softmax")
    plain = build(load_balancing_type="none", score_function=layer.moe.score_function)
    plain.load_state_dict(layer.state_dict())
    x = torch.randn(s, b, 16, generator=torch.Generator().manual_seed(5))
    scale = 0.25
    layer.router.loss_backward_scale = scale
    with_loss, without = _loss_grad(layer, x, coeff), _loss_grad(plain, x, coeff)

    w = layer.router.weight.detach().clone().requires_grad_()
    logits = x.reshape(s * b, 16) @ w.t()
    if kind == "z_loss":
        direct = coeff * sum(torch.logsumexp(row, 0) ** 2 for row in logits) / (s * b)
    else:
        scores = torch.softmax(logits, -1) if kind == "aux_loss" else torch.sigmoid(logits)
        if kind != "aux_loss":
            scores = scores / scores.sum(-1, keepdim=True)

        def switch(rows):
            T = len(rows)
            top = [set(torch.topk(r, k).indices.tolist()) for r in rows]
            f = [sum(e in t for t in top) / (T * k) for e in range(E)]
            P = [sum(r[e] for r in rows) / T for e in range(E)]
            return coeff * E * sum(fi * pi for fi, pi in zip(f, P))
        if kind == "aux_loss":
            direct = switch(list(scores))
        else:  # rows are [seq, batch] ordered: sequence j is rows j, j + b, ...
            direct = sum(switch(list(scores[j::b])) for j in range(b)) / b
    logged = pop_logged_losses([torch.nn.ModuleDict({"0": torch.nn.ModuleDict({"mlp": layer})})])
    name = {"aux_loss": "load_balancing_loss", "seq_aux_loss": "seq_load_balancing_loss"}.get(kind, kind)
    assert logged[name][0] == pytest.approx(float(direct.detach()) / coeff, rel=1e-5)
    (direct_grad,) = torch.autograd.grad(direct, w)
    torch.testing.assert_close(with_loss - without, scale * direct_grad, rtol=1e-4, atol=1e-7)


def test_attach_loss_is_identity_forward():
    x = torch.randn(3, requires_grad=True)
    loss = (x * 2).sum()
    y = AttachLoss.apply(x, loss, 0.5)
    assert torch.equal(y, x)
    y.sum().backward()
    torch.testing.assert_close(x.grad, torch.full((3,), 2.0))  # 1 from y, 0.5 * 2 from the loss


def test_expert_bias_moves_load_toward_balance():
    layer = build(score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.005,
                  load_balancing_type="none")
    with torch.no_grad():
        layer.router.weight[0] += 0.1  # a router that prefers experts 0 and 1 for mostly positive inputs
        layer.router.weight[1] += 0.07
    x = torch.rand(16, 4, 16, generator=torch.Generator().manual_seed(7)) - 0.2
    chunks = [torch.nn.ModuleDict({"0": torch.nn.ModuleDict({"mlp": layer})})]
    imbalance = []
    for _ in range(60):
        layer(x)
        counts = layer.router.tokens_per_expert.clone()
        imbalance.append(float(counts.max() / counts.mean()))
        update_expert_bias(chunks, None)
        assert float(layer.router.tokens_per_expert.sum()) == 0
    assert imbalance[0] > 3.5 and max(imbalance[-10:]) < 1.8, imbalance
    assert layer.router.expert_bias[0] < 0 < layer.router.expert_bias[5]
    assert "router.expert_bias" in layer.state_dict()


def test_layer_freq_patterns():
    assert parse_layer_freq("2") == 2
    assert parse_layer_freq("([0]+[1]*2)*2") == [0, 1, 1, 0, 1, 1]
    with pytest.raises(ValueError, match="--moe-layer-freq"):
        parse_layer_freq("__import__('os')")
    config = tiny_config(num_layers=4, layer_freq=2)
    assert config.moe.layer_pattern(4) == [1, 0, 1, 0]
    with pytest.raises(ValueError, match="one 0 or 1 per layer"):
        tiny_config(num_layers=4, layer_freq=[1, 0])
