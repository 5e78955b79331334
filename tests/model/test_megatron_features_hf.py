"""Megatron's model variants that Hugging Face also has, against transformers with the same
weights: Qwen3's qk-norm (--qk-layernorm), Llama 3.1 RoPE scaling (--use-rope-scaling) and
linear position interpolation (--rotary-seq-len-interpolation-factor); logits within 1e-4,
through the conversion mapping both ways. Each case also checks that the feature changes the
logits, so a model that ignored it would fail."""

import pytest
import torch

from megalite.model.gpt import GPTModel
from megalite.checkpoint.hf.mapping import config_from_hf, hf_config_dict
from megalite.model.rope import rotary_inv_freq
from megalite.checkpoint.hf.weights import export_hf_weights, load_hf_weights

transformers = pytest.importorskip("transformers")

VOCAB, SEQ = 256, 64


def llama3(**changes) -> dict:
    """A fresh rope_scaling dict (transformers' configs write into the one they are given)."""
    return {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192, **changes}


def hf_model(kind: str):
    torch.manual_seed(0)
    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=VOCAB, initializer_range=0.1, rms_norm_eps=1e-5,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0, rope_theta=1e6)
    if kind == "qwen3":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
            **common, head_dim=16, max_position_embeddings=SEQ, tie_word_embeddings=False))
        with torch.no_grad():  # norms start at 1: make the qk-norm weights matter
            for name, p in model.named_parameters():
                if "norm" in name:
                    p.uniform_(0.5, 1.5)
    else:
        rope = llama3() if kind == "llama3" else {"rope_type": "linear", "factor": 4.0}
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            **common, max_position_embeddings=16384, rope_scaling=rope))
    return model.eval()


def logits_of(config, hf_state):
    model = GPTModel(config).eval()
    load_hf_weights(model, hf_state)
    tokens = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        return model(tokens)[..., :VOCAB], tokens, model


@pytest.mark.parametrize("kind, field, off", [
    ("qwen3", "qk_layernorm", False),
    ("llama3", "use_rope_scaling", False),
    ("linear", "rotary_seq_len_interpolation_factor", None),
])
def test_matches_transformers(kind, field, off):
    hf = hf_model(kind)
    config = config_from_hf(hf.config)
    assert getattr(config, field) not in (False, None), f"{kind}: {field} not read from the HF config"
    hf_state = hf.state_dict()
    ours, tokens, model = logits_of(config, hf_state)
    with torch.no_grad():
        reference = hf(tokens).logits
    diff = (ours - reference).abs().max().item()
    assert diff <= 1e-4, f"{kind}: logits differ by {diff:.2e}"
    if kind != "qwen3":  # without the feature (same weights) the logits move well beyond the tolerance
        plain, _, _ = logits_of(config.replace(**{field: off}), hf_state)
        assert (plain - reference).abs().max().item() > 1e-3
    back = export_hf_weights(model)
    assert set(back) == set(hf_state) and all(torch.equal(back[n], hf_state[n]) for n in back)
    again = config_from_hf(hf_config_dict(config))
    assert again.to_dict() == config.to_dict()
    rebuilt = type(hf)(type(hf.config)(**hf_config_dict(config), pad_token_id=0)).eval()
    rebuilt.load_state_dict(hf_state)
    with torch.no_grad():
        assert (rebuilt(tokens).logits - reference).abs().max().item() <= 1e-5


def test_qk_layernorm_changes_the_model():
    hf = hf_model("qwen3")
    config = config_from_hf(hf.config)
    ours, _, _ = logits_of(config, hf.state_dict())
    state = {n: t for n, t in hf.state_dict().items() if "q_norm" not in n and "k_norm" not in n}
    plain, _, _ = logits_of(config.replace(qk_layernorm=False), state)
    assert (plain - ours).abs().max().item() > 1e-3


def test_llama3_frequencies_match_transformers():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf_config = transformers.LlamaConfig(hidden_size=512, num_attention_heads=4, rope_theta=500000.0,
                                         max_position_embeddings=131072, rope_scaling=llama3())
    reference, _ = ROPE_INIT_FUNCTIONS["llama3"](hf_config, "cpu")
    ours = rotary_inv_freq(128, 500000.0, rope_scaling_factor=8.0)
    torch.testing.assert_close(ours, reference.float(), rtol=1e-6, atol=0)
    plain = rotary_inv_freq(128, 500000.0)
    assert (ours < plain).any() and (ours == plain).any()  # some scaled, the fastest kept


@pytest.mark.parametrize("rope, message", [
    (llama3(low_freq_factor=2.0), "low_freq_factor"),
    (llama3(original_max_position_embeddings=4096), "original_max_position_embeddings"),
    ({"rope_type": "yarn", "factor": 4.0}, "rope_type 'default', 'linear' or 'llama3'"),
])
def test_rope_scaling_megatron_cannot_express_is_refused(rope, message):
    config = hf_config_dict(config_from_hf(hf_model("llama3").config))
    config.pop("rope_parameters", None)
    config["rope_scaling"] = rope
    with pytest.raises(ValueError, match=message):
        config_from_hf(config)
