"""A plain-loop reference of an MoE layer at EP = 1: every token, expert and capacity decision
written out one at a time, for the MoE tests to compare megalite's MoELayer against."""

import math

import torch
import torch.nn.functional as F

from megalite.model.config import GPTConfig
from megalite.model.moe_config import MoEConfig


def tiny_config(activation="swiglu", sequence_parallel=False, num_layers=2, **moe) -> GPTConfig:
    moe = {"num_experts": 8, "ffn_hidden_size": 24, "router_topk": 2, **moe}
    return GPTConfig(num_layers=num_layers, hidden_size=16, num_attention_heads=4, vocab_size=64,
                     ffn_hidden_size=32, activation=activation, add_bias_linear=False,
                     normalization="RMSNorm", position_embedding_type="rope", hidden_dropout=0.0,
                     attention_dropout=0.0, sequence_parallel=sequence_parallel,
                     untie_embeddings_and_output_weights=True, moe=MoEConfig(**moe))


def reference_choice(logit_row, moe, bias=None):
    """(experts, weights) of one token, by the definitions in Megatron's docs."""
    E, k = moe.num_experts, moe.router_topk
    if moe.score_function == "softmax":
        scores = torch.softmax(logit_row.double(), -1) if moe.pre_softmax else logit_row.double()
    else:
        scores = torch.sigmoid(logit_row.double())
    key = scores + bias.double() if bias is not None else scores
    allowed = list(range(E))
    if moe.group_topk:
        size = E // moe.num_groups
        group_score = [sorted(key[g * size:(g + 1) * size].tolist(), reverse=True)[:k // moe.group_topk]
                       for g in range(moe.num_groups)]
        best = sorted(range(moe.num_groups), key=lambda g: -sum(group_score[g]))[:moe.group_topk]
        allowed = [e for g in best for e in range(g * size, (g + 1) * size)]
    chosen = sorted(allowed, key=lambda e: -float(key[e].detach()))[:k]
    picked = scores[chosen]
    if moe.score_function == "softmax" and not moe.pre_softmax:
        picked = torch.softmax(picked, -1)
    elif moe.score_function == "sigmoid" and k > 1:
        picked = picked / (picked.sum() + 1e-20)
    if moe.topk_scaling_factor:
        picked = picked * moe.topk_scaling_factor
    return chosen, picked


def reference_kept(choices, moe, num_tokens):
    """{(token, expert)} kept under the capacity rule."""
    pairs = {(t, e): float(w.detach()) for t, (experts, weights) in enumerate(choices) for e, w in zip(experts, weights)}
    if moe.capacity_factor is None:
        return set(pairs)
    capacity = math.ceil(num_tokens * moe.router_topk / moe.num_experts * moe.capacity_factor)
    kept = set()
    for e in range(moe.num_experts):
        routed = [t for t in range(num_tokens) if (t, e) in pairs]
        if moe.token_drop_policy == "probs":
            routed.sort(key=lambda t: (-pairs[(t, e)], t))
        kept |= {(t, e) for t in routed[:capacity]}
    return kept


def expert_forward(x, fc1, fc2, activation):
    h = x @ fc1.t()
    if activation == "swiglu":
        gate, up = h.chunk(2, -1)
        h = F.silu(gate) * up
    else:
        h = F.gelu(h)
    return h @ fc2.t()


def reference_moe(layer, x):
    """Output [s, b, h] and the kept (token, expert) pairs of `layer` (an EP=1 MoELayer)."""
    moe, cfg = layer.moe, layer.config
    s, b, h = x.shape
    tokens = x.reshape(s * b, h)
    logits = tokens @ layer.router.weight.t()
    choices = [reference_choice(logits[t], moe, layer.router.expert_bias) for t in range(s * b)]
    kept = reference_kept(choices, moe, s * b)
    rows = []
    for t, (experts, weights) in enumerate(choices):
        out = tokens.new_zeros(h)
        for e, w in zip(experts, weights):
            if (t, e) in kept:
                ex = layer.local_experts[str(e)]
                out = out + w.to(tokens.dtype) * expert_forward(tokens[t], ex.linear_fc1.weight,
                                                                ex.linear_fc2.weight, cfg.activation)
        rows.append(out)
    out = torch.stack(rows).view(s, b, h)
    if layer.shared_experts is not None:
        sh = layer.shared_experts
        y = expert_forward(x, sh.linear_fc1.weight, sh.linear_fc2.weight, cfg.activation)
        if sh.gate_weight is not None:
            y = y * torch.sigmoid(x @ sh.gate_weight.t())
        out = out + y
    return out, kept
