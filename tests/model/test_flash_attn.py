"""--use-flash-attn: attention through the flash_attn package's flash_attn_func.

flash_attn needs a GPU, so a stand-in module is put in sys.modules (flash_attn_standin.py): its
flash_attn_func checks the arguments it gets (the [b, s, heads, d] layout, grouped k/v heads)
and computes attention with plain torch ops, honouring causal, softmax_scale and dropout_p as
the real one does. The model with it must equal the model through scaled_dot_product_attention
(fp32, 1e-5 relative), which fails if megalite's transposes, causal flag or scale are wrong.
With context parallelism: test_flash_attn_context_parallel.py.
"""

import sys

import pytest
import torch

from megalite.model.attention import SelfAttention
from megalite.model.gpt import GPTModel, masked_mean_loss
from megalite.parallel.random import MODEL_PARALLEL_RNG, RNGTracker
from tests.model.flash_attn_standin import standin_modules
from tests.model.test_gpt_tp import BATCH, SEQ, batch, make_config
from tests.numerics import assert_rel_close

TOL = 1e-5


@pytest.fixture
def flash_calls(monkeypatch):
    """Calls of the stand-in flash_attn_func, installed as the flash_attn module."""
    calls = []
    for name, module in standin_modules(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    return calls


def _attention(config, **kwargs) -> SelfAttention:
    """One attention layer with random weights (GPTModel initialises them, the layer alone does not)."""
    attention = SelfAttention(config, **kwargs)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in attention.parameters():
            p.copy_(0.2 * torch.randn(p.shape, generator=g))
    return attention


def _loss_logits_grads(config):
    model = GPTModel(config, init_seed=7)
    tokens, labels, mask = batch()
    loss = masked_mean_loss(model(tokens, labels=labels), mask)
    loss.backward()
    with torch.no_grad():
        logits = model(tokens)
    return loss.detach(), logits, {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("family, changes", [
    ("gpt2", {}),
    ("llama", {}),  # grouped-query attention: 8 query heads, 4 k/v heads
    ("llama", {"recompute_granularity": "selective"}),
], ids=["gpt2", "llama-gqa", "llama-selective-recompute"])
def test_flash_attn_equals_sdpa(flash_calls, family, changes):
    config = make_config(family, **changes)
    flash = _loss_logits_grads(config.replace(use_flash_attn=True))
    layers_run = config.num_layers * (3 if changes else 2)  # forward, (recompute,) no-grad forward
    assert len(flash_calls) == layers_run, f"flash_attn_func called {len(flash_calls)} times"
    sdpa = _loss_logits_grads(config)
    assert len(flash_calls) == layers_run, "the model without --use-flash-attn called flash_attn"
    head_dim = config.kv_channels
    for call in flash_calls:
        assert call["q"] == (BATCH, SEQ, config.num_attention_heads, head_dim)
        assert call["k"] == (BATCH, SEQ, config.num_query_groups, head_dim)
        assert call["causal"] is True and call["dropout_p"] == 0.0
        assert call["softmax_scale"] == pytest.approx(head_dim ** -0.5, rel=1e-12)
    assert_rel_close(flash[0], sdpa[0], TOL, f"{family} loss")
    assert_rel_close(flash[1], sdpa[1], TOL, f"{family} logits")
    for name, grad in sdpa[2].items():
        assert_rel_close(flash[2][name], grad, TOL, f"{family} grad {name}")


def test_dropout_is_passed_in_training_only_and_draws_from_the_tp_stream(flash_calls):
    config = make_config("llama", use_flash_attn=True, attention_dropout=0.25)
    tracker = RNGTracker()
    tracker.add(MODEL_PARALLEL_RNG, 1234)
    attention = _attention(config, rng_tracker=tracker)
    x = torch.randn(SEQ, BATCH, config.hidden_size)
    stream = tracker.get_states()[MODEL_PARALLEL_RNG]
    default_before = torch.get_rng_state()
    attention.train()(x)
    assert flash_calls[-1]["dropout_p"] == 0.25
    assert torch.equal(flash_calls[-1]["rng_state"], stream), "dropout did not draw from the tracker's stream"
    assert torch.equal(torch.get_rng_state(), default_before), "attention dropout advanced the default stream"
    attention.eval()(x)
    assert flash_calls[-1]["dropout_p"] == 0.0


def test_masked_attention_goes_through_sdpa(flash_calls):
    """A mask (the KV cache's decoding steps) is something flash_attn_func cannot take."""
    config = make_config("gpt2", use_flash_attn=True)
    attention = _attention(config).eval()
    x = torch.randn(4, 1, config.hidden_size)
    allowed = torch.ones(4, 4, dtype=torch.bool).tril()
    with torch.no_grad():
        masked = attention(x, attention_mask=~allowed.view(1, 1, 4, 4))
        assert not flash_calls
        causal = attention(x)
    assert len(flash_calls) == 1
    assert_rel_close(masked, causal, TOL, "explicit causal mask vs flash_attn causal")


def test_missing_package_is_named(monkeypatch):
    monkeypatch.setitem(sys.modules, "flash_attn", None)  # `import flash_attn` raises ImportError
    attention = _attention(make_config("gpt2", use_flash_attn=True))
    with pytest.raises(RuntimeError, match="--use-flash-attn needs the flash_attn package"):
        attention(torch.randn(4, 1, attention.config.hidden_size))
