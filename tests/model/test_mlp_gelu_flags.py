"""Which GeLU an MLP computes under Megatron's flags, as Megatron-Core's MLP does: with biases the
default bias-GeLU fusion is the tanh approximation (megatron/core/fusions/fused_bias_gelu.py),
--no-bias-gelu-fusion the exact erf form; without biases Megatron turns the fusion off (exact);
--openai-gelu is tanh either way; SwiGLU models are untouched. The printed conversion flags keep
each converted model's GeLU."""

import json

import pytest
import torch
import torch.nn.functional as F

from megalite.config.arguments import model_config_from_args, parse_args
from megalite.convert.hints import model_flags
from megalite.model.config import GPTConfig
from megalite.model.mlp import MLP

MODEL = ["--num-layers", "1", "--hidden-size", "16", "--num-attention-heads", "2", "--seq-length", "8",
         "--ffn-hidden-size", "32"]


def _mlp_output(flags):
    """(MLP output, tanh reference, exact reference) for a model built from `flags`."""
    config = model_config_from_args(parse_args(MODEL + flags), 64)
    mlp = MLP(config.replace(fused_kernels=False))
    with torch.no_grad():
        for p in mlp.parameters():  # biases too: their place (inside the GeLU) matters
            p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
        x = 2 * torch.randn(3, 16, generator=torch.Generator().manual_seed(1))
        out = mlp(x)
        fc1, fc2 = mlp.linear_fc1, mlp.linear_fc2
        pre = F.linear(x, fc1.weight, fc1.bias)
        refs = [F.linear(F.gelu(pre, approximate=a), fc2.weight, fc2.bias) for a in ("tanh", "none")]
    return config.activation, out, *refs


@pytest.mark.parametrize("flags, activation, tanh", [
    ([], "openai_gelu", True),  # GPT-2 style: gelu, biases, the fusion on by default
    (["--no-bias-gelu-fusion"], "gelu", False),
    (["--disable-bias-linear"], "gelu", False),  # Megatron turns the fusion off without biases
    (["--disable-bias-linear", "--no-bias-gelu-fusion"], "gelu", False),
    (["--openai-gelu"], "openai_gelu", True),
    (["--openai-gelu", "--no-bias-gelu-fusion"], "openai_gelu", True),
    (["--openai-gelu", "--disable-bias-linear"], "openai_gelu", True),
])
def test_gelu_form_under_each_flag(flags, activation, tanh):
    found, out, tanh_ref, exact_ref = _mlp_output(flags)
    assert found == activation
    assert (tanh_ref - exact_ref).abs().max() > 1e-4  # the two forms are told apart here
    torch.testing.assert_close(out, tanh_ref if tanh else exact_ref, rtol=1e-6, atol=1e-6)


def test_swiglu_and_squared_relu_are_unchanged():
    for flags, activation in ((["--swiglu"], "swiglu"), (["--swiglu", "--no-bias-gelu-fusion"], "swiglu"),
                              (["--squared-relu", "--no-bias-gelu-fusion"], "squared_relu")):
        assert model_config_from_args(parse_args(MODEL + flags), 64).activation == activation


@pytest.mark.parametrize("activation, bias, printed", [
    ("gelu", True, ["--no-bias-gelu-fusion"]), ("gelu", False, []), ("openai_gelu", True, ["--openai-gelu"]),
    ("openai_gelu", False, ["--openai-gelu"]),
])
def test_printed_flags_keep_the_gelu_form(activation, bias, printed):
    config = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64, activation=activation,
                       add_bias_linear=bias, max_position_embeddings=8)
    flags = model_flags(config)
    assert [f for f in flags if "gelu" in f] == printed
    assert model_config_from_args(parse_args(flags), 64).activation == activation
    unfused = model_flags(config.replace(unfused_kernels=("bias_gelu",)))
    assert unfused.count("--no-bias-gelu-fusion") == 1


def test_a_checkpoint_of_exact_gelu_with_biases_needs_the_flag_on_resume():
    """A megalite checkpoint trained with exact GeLU and biases (these flags' model before they
    followed Megatron-Core) is refused on --load naming --no-bias-gelu-fusion, which resumes it."""
    from dataclasses import asdict

    from megalite.checkpoint.dcp.format import CheckpointError
    from megalite.checkpoint.model_match import check_model_matches

    stored = GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64, max_position_embeddings=8,
                       ffn_hidden_size=32)
    stored = json.loads(json.dumps(asdict(stored)))  # as common.json holds it
    with pytest.raises(CheckpointError, match=r"activation='gelu' but this run's has 'openai_gelu' \(.*"
                                              r"--no-bias-gelu-fusion\)"):
        check_model_matches(stored, model_config_from_args(parse_args(MODEL), 64), "ckpt", new_run=False)
    exact = model_config_from_args(parse_args(MODEL + ["--no-bias-gelu-fusion"]), 64)
    assert check_model_matches(stored, exact, "ckpt", new_run=False) == []
