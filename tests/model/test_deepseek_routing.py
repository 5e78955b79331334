"""DeepSeek's MoE routing in megalite against Megatron-Core's own functions (megatron-core's
moe_utils, installed in the venv): top-k probabilities and routing maps for sigmoid scores with
the expert bias, group-limited routing (DeepSeek-V3's 8 groups, 4 chosen) and the top-k scaling
factor, and for the softmax variants; the sequence-level auxiliary loss; the aux-loss-free bias
update. Same logits, same results (probabilities to 1e-6, maps exactly)."""

import pytest
import torch

from megalite.model.moe_config import MoEConfig
from megalite.model.moe_router import aux_loss_scores, seq_aux_loss, topk_routing

moe_utils = pytest.importorskip("megatron.core.transformer.moe.moe_utils")

CASES = {
    "deepseek-v3": dict(score_function="sigmoid", enable_expert_bias=True, num_groups=8, group_topk=4,
                        topk_scaling_factor=2.5),
    "sigmoid": dict(score_function="sigmoid"),
    "sigmoid-bias-scaled": dict(score_function="sigmoid", enable_expert_bias=True, topk_scaling_factor=1.5),
    "softmax-pre": dict(pre_softmax=True),
    "softmax-grouped": dict(num_groups=4, group_topk=2),
}


def _logits(tokens=64, experts=32, seed=0):
    return torch.randn(tokens, experts, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.mark.parametrize("case", list(CASES))
def test_routing_equals_megatron_core(case):
    moe = MoEConfig(num_experts=32, ffn_hidden_size=8, router_topk=8, **CASES[case])
    logits = _logits()
    bias = torch.randn(32, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 0.1 \
        if moe.enable_expert_bias else None
    probs, routing_map = topk_routing(logits, moe, bias)
    want_probs, want_map = moe_utils.topk_routing_with_score_function(
        logits, moe.router_topk, use_pre_softmax=moe.pre_softmax, num_groups=moe.num_groups,
        group_topk=moe.group_topk, scaling_factor=moe.topk_scaling_factor, score_function=moe.score_function,
        expert_bias=bias)
    assert torch.equal(routing_map, want_map)
    torch.testing.assert_close(probs, want_probs, rtol=1e-6, atol=1e-12)
    if moe.group_topk:  # every token's experts lie in group_topk groups
        groups = routing_map.view(64, moe.num_groups, -1).any(-1).sum(-1)
        assert (groups <= moe.group_topk).all()


@pytest.mark.parametrize("score_function", ["sigmoid", "softmax"])
def test_sequence_auxiliary_loss_equals_megatron_core(score_function):
    s, b, experts, topk, coeff = 16, 3, 32, 8, 1e-3
    moe = MoEConfig(num_experts=experts, ffn_hidden_size=8, router_topk=topk, score_function=score_function,
                    load_balancing_type="seq_aux_loss", aux_loss_coeff=coeff)
    logits = _logits(s * b, experts, seed=2)  # rows in [seq, batch] order
    scores, top_map = aux_loss_scores(logits, moe)
    counts = top_map.view(s, b, -1).sum(0).to(scores.dtype)
    loss = seq_aux_loss(scores.view(s, b, -1), counts, s, topk, coeff)
    want_map, want_scores = moe_utils.compute_routing_scores_for_aux_loss(logits, topk, score_function)
    want_map = want_map.reshape(s, -1)
    want = moe_utils.switch_load_balancing_loss_func(
        want_scores.reshape(s, -1), want_map.sum(0), s, topk, experts, coeff) / b  # Megatron's _apply_seq_aux_loss
    torch.testing.assert_close(loss, want, rtol=1e-12, atol=0)


def test_expert_bias_update_equals_megatron_core(monkeypatch):
    from megalite.model.moe import MoELayer, update_expert_bias
    from tests.model.moe_reference import tiny_config

    config = tiny_config(score_function="sigmoid", enable_expert_bias=True, bias_update_rate=0.01)
    layer = MoELayer(config)
    counts = torch.tensor([5.0, 0.0, 9.0, 2.0, 2.0, 7.0, 1.0, 6.0])
    layer.router.tokens_per_expert.copy_(counts)
    layer.router.expert_bias.copy_(torch.linspace(-0.1, 0.1, 8))
    monkeypatch.setattr(torch.distributed, "all_reduce", lambda tensor, group=None: tensor)  # one rank
    monkeypatch.setattr(moe_utils.parallel_state, "get_tensor_and_data_parallel_group", lambda **kw: None)
    want = moe_utils.get_updated_expert_bias(counts.clone(), layer.router.expert_bias.clone(), 0.01)
    update_expert_bias([layer], None)
    torch.testing.assert_close(layer.router.expert_bias, want, rtol=0, atol=0)
    assert layer.router.tokens_per_expert.sum() == 0  # counted afresh for the next step
