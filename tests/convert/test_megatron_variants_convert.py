"""tools/checkpoint/convert.py carries Megatron's model variants that Hugging Face can hold:
Llama 3.1 RoPE scaling (rope_scaling rope_type 'llama3' <-> --use-rope-scaling) and Qwen3's
qk-norm (<-> --qk-layernorm), Hugging Face -> megalite (TP=2) -> Hugging Face, with the
training flags the converter suggests, and logits within 1e-4 of the original."""

import json
from pathlib import Path

import pytest
import torch

from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
from tests.convert.hf_models import hf_to_megalite, megalite_to_hf, save_hf

transformers = pytest.importorskip("transformers")


def _model(kind: str):
    torch.manual_seed(0)
    common = dict(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=96, vocab_size=300, initializer_range=0.1, rms_norm_eps=1e-5,
                  bos_token_id=0, eos_token_id=0, pad_token_id=0, max_position_embeddings=16384,
                  rope_theta=1e6)
    if kind == "qwen3":
        return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16)).eval()
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192}
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, rope_scaling=rope)).eval()


@pytest.mark.parametrize("kind, field", [("llama3", "use_rope_scaling"), ("qwen3", "qk_layernorm")])
def test_round_trip_keeps_the_variant(tmp_path, kind, field):
    model = _model(kind)
    ckpt = hf_to_megalite(save_hf(model, tmp_path / "hf"), tmp_path / "ml", tp=2)
    assert getattr(MegaliteCheckpoint(ckpt).config, field) is True
    megalite_to_hf(ckpt, tmp_path / "back")
    config = json.loads((Path(tmp_path / "back") / "config.json").read_text())
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(back) is type(model)
    if kind == "llama3":
        scaling = config.get("rope_scaling") or config.get("rope_parameters")
        assert scaling["rope_type"] == "llama3" and scaling["factor"] == 8.0
    tokens = torch.randint(0, 300, (2, 48), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        diff = (back(tokens).logits - model(tokens).logits).abs().max().item()
    assert diff <= 1e-4, diff


def test_printed_flags_rebuild_every_variant():
    from megalite.convert.hints import model_flags
    from megalite.model.config import GPTConfig
    from megalite.config.arguments import model_config_from_args, parse_args

    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=300, max_position_embeddings=64,
                attention_dropout=0.0, hidden_dropout=0.0)
    variants = [
        dict(position_embedding_type="rope", qk_layernorm=True, apply_layernorm_1p=True, rotary_interleaved=True,
             use_rope_scaling=True, rope_scaling_factor=16.0, attention_backend="local",
             unfused_kernels=("rotary", "bias_gelu")),
        dict(position_embedding_type="rope", rotary_seq_len_interpolation_factor=2.5, activation="swiglu",
             unfused_kernels=("swiglu", "cross_entropy")),
        dict(position_embedding_type="none", activation="squared_relu", attention_backend="flash"),
    ]
    run = ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "0", "--mock-data",
           "--tokenizer-type", "NullTokenizer", "--vocab-size", "299"]
    for variant in variants:
        config = GPTConfig(**base, **variant)
        args = parse_args(model_flags(config) + run)
        assert model_config_from_args(args, 300).to_dict() == config.to_dict(), variant
