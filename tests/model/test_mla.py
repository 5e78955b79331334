"""Multi-latent attention and multi-token prediction in one process: every attention backend
serves the unequal query/key and value head widths with the same losses, logits and gradients
(SDPA auto, its flash kernel with padded values, the explicit paths, flash_attn's stand-in);
selective and full recompute change nothing; KV-cache generation gives the full forward's
logits; YaRN's frequencies and concentration are transformers' (factor 1 is plain RoPE); MTP
rolls tokens, labels and masks, and its loss is the masked mean of the shifted targets."""

import sys

import pytest
import torch

from megalite.inference.kv_cache import InferenceCache
from megalite.model.gpt import GPTModel, masked_mean_loss
from megalite.model.mla_config import MLAConfig, mla_cos_sin, yarn_inv_freq
from megalite.model.mtp import roll_left
from tests.model.flash_attn_standin import standin_modules
from tests.numerics import assert_rel_close
from tests.parallel.mla_harness import mla_config

TOL = 1e-5
VOCAB, SEQ = 64, 8


def _batch():
    g = torch.Generator().manual_seed(0)
    return (torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g),
            (torch.rand(2, SEQ, generator=g) > 0.2).float())


def _run(config):
    model = GPTModel(config, init_seed=3)
    tokens, labels, mask = _batch()
    loss = masked_mean_loss(model(tokens, labels=labels, loss_mask=mask), mask)
    loss.backward()
    with torch.no_grad():
        logits = model.eval()(tokens)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    return loss.detach(), logits, grads, [t / c for t, c in model.mtp.logged]


def _same(a, b, what):
    assert_rel_close(a[0], b[0], TOL, f"{what} loss")
    assert_rel_close(a[1], b[1], TOL, f"{what} logits")
    assert a[3] == pytest.approx(b[3], rel=TOL), f"{what} MTP losses"
    for name, grad in b[2].items():
        assert_rel_close(a[2][name], grad, TOL, f"{what} grad {name}")


@pytest.fixture(scope="module")
def reference():
    return _run(mla_config())


@pytest.mark.parametrize("changes", [
    dict(attention_backend="flash"), dict(attention_backend="fused"), dict(attention_backend="unfused"),
    dict(recompute_granularity="selective"), dict(recompute_granularity="full", recompute_num_layers=1),
], ids=["sdpa-flash", "sdpa-fused", "explicit", "selective-recompute", "full-recompute"])
def test_backends_and_recompute_equal_sdpa(reference, changes):
    _same(_run(mla_config(**changes)), reference, str(changes))


def test_flash_attn_pads_the_values(reference, monkeypatch):
    calls = []
    for name, module in standin_modules(calls).items():
        monkeypatch.setitem(sys.modules, name, module)
    config = mla_config()
    _same(_run(config.replace(use_flash_attn=True)), reference, "flash_attn")
    q_width = config.mla.q_head_dim
    assert calls and all(call["q"][-1] == call["k"][-1] == q_width for call in calls)  # one width, v padded


def test_generation_with_a_kv_cache_equals_the_full_forward():
    model = GPTModel(mla_config(mtp_num_layers=None), init_seed=3).eval()
    tokens = _batch()[0]
    with torch.no_grad():
        full = model(tokens)
        cache = InferenceCache(SEQ)
        steps = [model(tokens[:, :3], inference_cache=cache)]
        cache.advance(3)
        for i in range(3, SEQ):
            steps.append(model(tokens[:, i:i + 1], inference_cache=cache))
            cache.advance(1)
    assert_rel_close(torch.cat(steps, dim=1), full, TOL, "cached logits")


def test_yarn_equals_transformers():
    from transformers import DeepseekV3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
            "beta_fast": 32, "beta_slow": 1, "mscale": 0.8, "mscale_all_dim": 0.6}
    hf = DeepseekV3Config(qk_rope_head_dim=64, rope_parameters=rope, max_position_embeddings=163840)
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf, "cpu")
    mla = MLAConfig(kv_lora_rank=8, qk_pos_emb_head_dim=64, rotary_scaling_factor=40.0, mscale=0.8,
                    mscale_all_dim=0.6)
    torch.testing.assert_close(yarn_inv_freq(64, 10000.0, mla), inv_freq.float(), rtol=1e-6, atol=0)
    assert mla.concentration() == pytest.approx(attention_factor, rel=1e-12)
    plain = mla_config(mla={**mla.to_dict(), "rotary_scaling_factor": 1.0, "mscale_all_dim": 0.0})
    as_rope = plain.replace(mla={**plain.mla.to_dict(), "rope_type": "rope"})
    for a, b in zip(mla_cos_sin(plain, 32), mla_cos_sin(as_rope, 32)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)  # the blend of two equal frequencies rounds


def test_roll_left_shifts_and_zero_fills():
    t = torch.arange(12).view(2, 6)
    assert roll_left(t).tolist() == [[1, 2, 3, 4, 5, 0], [7, 8, 9, 10, 11, 0]]


def test_mtp_loss_is_the_masked_mean_of_the_shifted_targets():
    """Depth k's logged loss equals the model's own per-token loss of hidden state k against
    labels shifted by k, averaged where the shifted mask is 1."""
    config = mla_config(moe=None, mtp_num_layers=2)
    model = GPTModel(config, init_seed=3)
    tokens, labels, mask = _batch()
    captured = []
    original = model.token_losses
    model.token_losses = lambda x, y: captured.append((x, y)) or original(x, y)
    model(tokens, labels=labels, loss_mask=mask)
    (h1, y1), (h2, y2), _ = captured
    assert torch.equal(y1, roll_left(labels)) and torch.equal(y2, roll_left(roll_left(labels)))
    for depth, (hidden, shifted) in enumerate(((h1, y1), (h2, y2))):
        m = mask
        for _ in range(depth + 1):
            m = roll_left(m)
        want = (original(hidden, shifted) * m).sum() / m.sum()
        assert model.mtp.logged[depth][0] == pytest.approx(float(want.detach()), rel=1e-6)
