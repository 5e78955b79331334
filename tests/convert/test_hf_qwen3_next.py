"""Hugging Face Qwen3NextForCausalLM (a tiny random model: Gated DeltaNet and gated full attention
layers, partial rotary, zero-centred norms, MoE with a gated shared expert) against megalite:
logits within 1e-4 on converted weights, the config both ways, and the converter's
hf -> megalite (TP1, and TP2 PP2) -> hf bit-identical."""

import pytest
import torch

from megalite.checkpoint.hf.mapping import config_from_hf, family_of, hf_config_dict
from megalite.checkpoint.hf.mapping_moe import split_fused_experts
from megalite.checkpoint.hf.weights import export_hf_weights, load_hf_weights
from megalite.model.gpt import GPTModel
from megalite.parallel.state import ParallelState
from tests.convert.hf_qwen3_next_models import VOCAB, hf_qwen3_next_model, tokens
from tests.numerics import rel_error

pytest.importorskip("transformers")


def test_logits_match_transformers_and_export_is_exact():
    import transformers

    hf = hf_qwen3_next_model()
    config = config_from_hf(hf.config)
    assert family_of(config) == "qwen3_next" and config.gdn.linear_attention_freq == 2
    assert config.rotary_percent == 0.25 and config.apply_layernorm_1p and config.attention_output_gate
    assert config.moe.layer_pattern(4) == [0, 1, 1, 1] and config.moe.shared_expert_gate
    assert config_from_hf(hf_config_dict(config)) == config
    assert config_from_hf(transformers.Qwen3NextConfig(**hf_config_dict(config))) == config
    model = GPTModel(config, ParallelState.single()).eval()
    load_hf_weights(model, hf.state_dict())
    with torch.no_grad():
        ours, theirs = model(tokens())[..., :VOCAB], hf(tokens()).logits
    assert (ours - theirs).abs().max() < 1e-4 and rel_error(ours, theirs) < 1e-5
    want = split_fused_experts(hf.state_dict(), config, "qwen3_next")
    got = export_hf_weights(model)
    assert set(got) == set(want) and all(torch.equal(got[n], t) for n, t in want.items())


def test_layer_pattern_as_a_list():
    """A pattern no interval gives stays a per-layer list both ways."""
    hf = hf_qwen3_next_model(layer_types=["linear_attention", "full_attention", "full_attention", "linear_attention"])
    config = config_from_hf(hf.config)
    assert config.gdn.linear_attention_freq == (1, 0, 0, 1)
    assert hf_config_dict(config)["layer_types"] == hf.config.layer_types


def test_refusals():
    config = config_from_hf(hf_qwen3_next_model().config)
    import dataclasses

    with pytest.raises(ValueError, match="apply_layernorm_1p"):
        family_of(dataclasses.replace(config, apply_layernorm_1p=False))
    with pytest.raises(ValueError, match="shared expert"):
        family_of(dataclasses.replace(config, moe=dataclasses.replace(config.moe, shared_expert_intermediate_size=None)))


def test_converter_round_trip_tp1_and_tp2_pp2_is_bit_identical(tmp_path):
    from safetensors.torch import load_file

    from tests.convert.hf_models import hf_to_megalite, megalite_to_hf as export, save_hf

    source = save_hf(hf_qwen3_next_model(), tmp_path / "hf")
    source_tensors = load_file(tmp_path / "hf" / "model.safetensors")
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in source_tensors
    for tp, pp in ((1, 1), (2, 2)):
        export(hf_to_megalite(source, tmp_path / f"ml{tp}{pp}", tp=tp, pp=pp), tmp_path / f"back{tp}{pp}")
        back = {}
        for path in (tmp_path / f"back{tp}{pp}").glob("*.safetensors"):
            back.update(load_file(path))
        assert set(back) == set(source_tensors), (tp, pp)
        assert all(torch.equal(back[n], t) for n, t in source_tensors.items()), (tp, pp)


def test_greedy_generation_matches_transformers():
    """tools/generate.py's generate_tokens (the linear layers' recurrent state and conv taps
    cached) on converted weights produces transformers' greedy continuation."""
    from megalite.inference.generate import generate_tokens

    hf = hf_qwen3_next_model()
    model = GPTModel(config_from_hf(hf.config), ParallelState.single()).eval()
    load_hf_weights(model, hf.state_dict())
    prompt = tokens(batch=1, seq=7)
    with torch.no_grad():
        # token 0 is the pad id: without an explicit mask transformers would mask the prompt's 0
        want = hf.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=10, do_sample=False, eos_token_id=None, min_new_tokens=10)
    ours = generate_tokens(model, prompt[0].tolist(), 10)
    assert ours == want[0, 7:].tolist()
