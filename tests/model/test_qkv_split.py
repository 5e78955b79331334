"""q, k and v from the fused QKV projection (attention.SplitGroupedQKV): the gradients of
slicing, bit for bit, written once into one tensor of the projection's shape, with no
full-size zeros, copies or adds in backward (the torch.profiler's operator list)."""

import pytest
import torch
from torch.profiler import ProfilerActivity, profile

from megalite.model.attention import SelfAttention, SplitGroupedQKV
from tests.model.test_megatron_features import make_config


def sliced(qkv, q_per_group):
    s, b, groups, _, d = qkv.shape
    q = qkv[:, :, :, :q_per_group].reshape(s, b, groups * q_per_group, d)
    return q, qkv[:, :, :, q_per_group], qkv[:, :, :, q_per_group + 1]


@pytest.mark.parametrize("groups, q_per_group", [(4, 2), (8, 1), (1, 4)])
@pytest.mark.parametrize("used", [(0, 1, 2), (0, 2), (1,)])
def test_split_matches_slicing_bit_for_bit(groups, q_per_group, used):
    torch.manual_seed(0)
    base = torch.randn(6, 2, groups, q_per_group + 2, 8, dtype=torch.bfloat16)
    weights = [torch.randn(6, 2, groups * n, 8, dtype=torch.bfloat16) for n in (q_per_group, 1, 1)]
    grads = []
    for split in (sliced, SplitGroupedQKV.apply):
        qkv = base.clone().requires_grad_()
        parts = split(qkv, q_per_group)
        for ours, ref in zip(parts, sliced(base, q_per_group)):
            assert torch.equal(ours, ref) and ours.shape == ref.shape
        # a permuted gradient, as scaled_dot_product_attention's [b, n, s, d] ones arrive
        loss = sum((parts[i].permute(1, 2, 0, 3) * weights[i].permute(1, 2, 0, 3)).float().sum() for i in used)
        loss.backward()
        grads.append(qkv.grad)
    assert torch.equal(grads[0], grads[1])


def backward_ops(family: str):
    torch.manual_seed(0)
    config = make_config(family)
    attention = SelfAttention(config)
    s, b = 16, 2
    out = attention(torch.randn(s, b, config.hidden_size, requires_grad=True))
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        out.backward(torch.randn_like(out))
    qkv_shape = [s, b, attention.groups, attention.q_per_group + 2, attention.head_dim]
    return [(e.name, e.input_shapes) for e in prof.events()], qkv_shape


@pytest.mark.parametrize("family", ["llama", "gpt2"])  # grouped queries (a copy of q), one head per group (views)
def test_backward_writes_the_qkv_gradient_once(family):
    ops, qkv_shape = backward_ops(family)
    full = [(name, shapes) for name, shapes in ops if name in ("aten::zero_", "aten::copy_", "aten::add_", "aten::add")
            and qkv_shape in shapes]
    assert full == [], full  # slicing's backward: a zeroed full-size tensor per part, copies, two adds
    assert [name for name, _ in ops].count("aten::cat") == 1
