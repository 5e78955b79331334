"""The model with megalite's Triton kernels on equals the model with them off (the plain-torch
references), forward and backward, fp32, both families. On CPU the kernels run in Triton's
interpreter (TRITON_INTERPRET=1, set before any Triton module is imported)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

from megalite.model.gpt import GPTModel, masked_mean_loss  # noqa: E402
from tests.model.test_gpt_tp import make_config  # noqa: E402
from tests.numerics import assert_rel_close  # noqa: E402

pytest.importorskip("triton")
TOL = 1e-5


def _run(config):
    torch.manual_seed(0)
    model = GPTModel(config, init_seed=3)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, config.vocab_size, (2, 8), generator=g)
    labels = torch.randint(0, config.vocab_size, (2, 8), generator=g)
    loss = masked_mean_loss(model(tokens, labels=labels), None)
    loss.backward()
    with torch.no_grad():
        logits = model(tokens)
    return loss.detach(), logits, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_kernels_on_equal_kernels_off(family):
    small = dict(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=70, max_position_embeddings=8)
    if family == "llama":
        small.update(num_query_groups=2, ffn_hidden_size=48)
    on = _run(make_config(family, fused_kernels=True, **small))
    off = _run(make_config(family, fused_kernels=False, **small))
    assert_rel_close(on[0], off[0], TOL, f"{family} loss")
    assert_rel_close(on[1], off[1], TOL, f"{family} logits")
    assert set(on[2]) == set(off[2])
    for name, grad in off[2].items():
        assert_rel_close(on[2][name], grad, TOL, f"{family} grad {name}")
