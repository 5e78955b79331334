"""megalite against Hugging Face transformers with the same weights (randomly initialised small
GPT2LMHeadModel and LlamaForCausalLM with grouped-query attention; nothing downloaded).
Logits within 1e-4 max abs difference at TP=1 and TP=2; every weight's gradient within 1e-5
relative. The weight mapping round-trips bit for bit."""

import pytest
import torch
import torch.nn.functional as F

from megalite.model.gpt import GPTModel
from megalite.checkpoint.hf.mapping import config_from_hf, hf_config_dict, hf_to_megalite
from megalite.checkpoint.hf.weights import export_hf_weights, load_hf_weights
from megalite.model.weights import gather_full_weights
from megalite.parallel import comm
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.distributed import run_distributed
from tests.numerics import assert_rel_close

transformers = pytest.importorskip("transformers")

VOCAB, BATCH, SEQ = 300, 2, 24


def hf_model(family: str):
    torch.manual_seed(0)
    if family == "gpt2":
        config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                         resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, initializer_range=0.1,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    else:
        config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4,
                                          num_key_value_heads=2, intermediate_size=96, vocab_size=VOCAB,
                                          max_position_embeddings=SEQ, initializer_range=0.1, rope_theta=500.0,
                                          rms_norm_eps=1e-5, bos_token_id=0, eos_token_id=0, pad_token_id=0)
        model = transformers.LlamaForCausalLM(config)
    return model.eval()


def data():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g), torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def hf_reference(family):
    model = hf_model(family)
    tokens, labels = data()
    logits = model(tokens).logits
    F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1)).backward()
    grads = {n: p.grad for n, p in model.named_parameters()}
    config = config_from_hf(model.config)
    full_grads = dict(hf_to_megalite(grads.__getitem__, config))
    return model, logits.detach(), full_grads


def megalite_run(family, hf_state, hf_config, state):
    config = config_from_hf(hf_config)
    model = GPTModel(config, state).eval()
    load_hf_weights(model, hf_state)
    tokens, labels = data()
    losses = model(tokens, labels=labels)
    losses.mean().backward()
    with torch.no_grad():
        logits = comm.gather_dim(model(tokens), -1, state.tp_group)[..., :VOCAB]
    return {"logits": logits, "grads": gather_full_weights(model, grads=True), "hf_back": export_hf_weights(model)}


def check(result, family):
    hf, ref_logits, ref_grads = hf_reference(family)
    diff = (result["logits"] - ref_logits).abs().max().item()
    assert diff <= 1e-4, f"{family}: logits differ by {diff:.2e}"
    for name, grad in ref_grads.items():
        ours = result["grads"][name]
        if "word_embeddings" in name or "output_layer" in name:
            ours = ours[:VOCAB]
        assert_rel_close(ours, grad, 1e-5, f"{family} grad {name}")
    hf_state = hf.state_dict()
    for name, tensor in result["hf_back"].items():
        assert torch.equal(tensor, hf_state[name]), f"{family}: {name} did not round-trip"
    tied = {"lm_head.weight"} if family == "gpt2" else set()
    assert set(result["hf_back"]) == set(hf_state) - tied


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_matches_transformers_tp1(family):
    model = hf_model(family)
    check(megalite_run(family, model.state_dict(), model.config, ParallelState.single()), family)


def _tp2_worker(rank, world_size, states):
    pstate = ParallelState.create(ParallelLayout(world_size, tensor=2))
    return {family: megalite_run(family, state, config, pstate) for family, (state, config) in states.items()}


def test_matches_transformers_tp2():
    states = {}
    for family in ("gpt2", "llama"):
        model = hf_model(family)
        states[family] = (model.state_dict(), model.config.to_dict())
    result = run_distributed(_tp2_worker, 2, states)[0]
    for family in ("gpt2", "llama"):
        check(result[family], family)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_config_round_trip(family):
    model = hf_model(family)
    config = config_from_hf(model.config)
    again = config_from_hf(hf_config_dict(config))
    assert again.to_dict() == config.to_dict()


@pytest.mark.parametrize("field, value, message", [
    ("model_type", "mistral", "model_type='mistral'"),
    ("rope_scaling", {"rope_type": "yarn", "factor": 2.0}, "rope_scaling="),
    ("hidden_act", "gelu", "hidden_act='gelu'"),
])
def test_unsupported_architectures_are_refused(field, value, message):
    config = hf_config_dict(config_from_hf(hf_model("llama").config))
    config[field] = value
    if field == "rope_scaling":
        config.pop("rope_parameters", None)
    with pytest.raises(ValueError, match=message):
        config_from_hf(config)
