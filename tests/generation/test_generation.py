"""KV cache, sampling and the generation loop: the cache reproduces the full forward pass, the
samplers only ever pick allowed tokens (never vocabulary padding), and generation stops at the
end-of-document token or the length limit."""

import pytest
import torch

from megalite.inference import InferenceCache, SamplingParams, generate_tokens, sample_next
from megalite.inference.sampling import filtered_logits
from megalite.model.gpt import GPTModel
from tests.model.test_gpt_tp import make_config

CACHE_TOL = 1e-5


def model_of(family, **overrides):
    return GPTModel(make_config(family, max_position_embeddings=40, **overrides), init_seed=3).eval()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_cached_forward_equals_full_forward(family):
    """Prefill in uneven pieces, then one token at a time, batch of 3: logits within 1e-5."""
    model = model_of(family)
    tokens = torch.randint(0, 250, (3, 30), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model(tokens)
        cache = InferenceCache(30)
        pieces = []
        for start, end in ((0, 7), (7, 8), (8, 19), *((i, i + 1) for i in range(19, 30))):
            pieces.append(model(tokens[:, start:end], inference_cache=cache))
            cache.advance(end - start)
    diff = (torch.cat(pieces, dim=1) - full).abs().max().item()
    assert diff <= CACHE_TOL, f"{family}: cached logits differ by {diff:.2e}"
    assert cache.offset == 30 and set(cache.layers) == {0, 1}


def test_cache_refuses_positions_beyond_its_length():
    model = model_of("llama")
    cache = InferenceCache(4)
    with torch.no_grad(), pytest.raises(ValueError, match="holds 4 positions"):
        model(torch.zeros(1, 5, dtype=torch.long), inference_cache=cache)


def test_cache_refuses_sequence_parallel():
    model = model_of("gpt2", sequence_parallel=True)
    with torch.no_grad(), pytest.raises(ValueError, match="sequence_parallel off"):
        model(torch.zeros(1, 2, dtype=torch.long), inference_cache=InferenceCache(4))


def test_greedy_picks_argmax_and_never_padding():
    logits = torch.tensor([[0.1, 2.0, 0.3, 50.0, 60.0]])  # ids 3 and 4 are vocabulary padding
    assert sample_next(logits, 3, SamplingParams(temperature=0)).tolist() == [1]
    assert sample_next(logits, 3, SamplingParams(top_k=1)).tolist() == [1]
    g = torch.Generator().manual_seed(0)
    drawn = {int(sample_next(logits, 3, SamplingParams(temperature=5.0), g)) for _ in range(300)}
    assert drawn == {0, 1, 2}


def test_top_k_and_top_p_keep_only_the_allowed_tokens():
    logits = torch.tensor([[3.0, 1.0, 2.0, 0.0, -1.0, 2.5]])
    g = torch.Generator().manual_seed(1)
    top2 = {int(sample_next(logits, 6, SamplingParams(top_k=2), g)) for _ in range(300)}
    assert top2 == {0, 5}
    # probabilities: 0: .459, 5: .279, 2: .169, 1: .062, ...; the mass before 2 is .738
    for top_p, kept in ((0.1, {0}), (0.7, {0, 5}), (0.75, {0, 5, 2})):
        assert {int(sample_next(logits, 6, SamplingParams(top_p=top_p), g)) for _ in range(500)} == kept
    # top-p applies to the top-k renormalised: 0: .507, 5: .308, 2: .186
    both = filtered_logits(logits, SamplingParams(top_k=3, top_p=0.6))
    assert torch.isfinite(both).nonzero()[:, 1].tolist() == [0, 5]


def test_temperature_sampling_follows_the_softmax():
    """20000 draws: each frequency within 0.015 of softmax(logits / T) (fixed seed)."""
    logits = torch.tensor([[1.0, 0.5, 0.0, -0.5]])
    g = torch.Generator().manual_seed(2)
    for temperature in (0.5, 1.0, 2.0):
        params = SamplingParams(temperature=temperature)
        draws = torch.stack([sample_next(logits.expand(1000, 4), 4, params, g) for _ in range(20)]).flatten()
        freq = torch.bincount(draws, minlength=4).float() / draws.numel()
        expected = torch.softmax(logits[0] / temperature, dim=0)
        assert (freq - expected).abs().max() < 0.015, f"T={temperature}: {freq} vs {expected}"


@pytest.mark.parametrize("bad, message", [({"temperature": -1}, "--temperature"), ({"top_k": -2}, "--top-k"),
                                          ({"top_p": 1.5}, "--top-p")])
def test_bad_sampling_options_are_refused(bad, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**bad)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_generation_stops_at_eod_and_at_the_position_limit(family):
    model = model_of(family)
    prompt = [4, 8, 15, 16, 23, 42]
    full = generate_tokens(model, prompt, 100)
    assert len(full) == 40 - len(prompt)  # cut at max_position_embeddings
    assert full == generate_tokens(model, prompt, 100, use_cache=False)
    eod = full[5]
    stopped = generate_tokens(model, prompt, 100, eod=eod)
    assert stopped == full[: full.index(eod) + 1]
    sampled = [generate_tokens(model, prompt, 12, SamplingParams(temperature=1.0, top_p=0.9),
                               generator=torch.Generator().manual_seed(s)) for s in (5, 5, 6)]
    assert sampled[0] == sampled[1] and sampled[0] != sampled[2]
    with pytest.raises(ValueError, match="leaves no room"):
        generate_tokens(model, list(range(40)), 1)
    with pytest.raises(ValueError, match="vocabulary"):
        generate_tokens(model, [250], 1)
