"""--quantize: torchao's weight-only INT8 on megalite's TP linears (the weights really are int8,
the logits stay within a stated tolerance of fp32, greedy generation agrees), the refusals where
it cannot run, and the one line naming the extra when torchao is missing."""

import pytest
import torch

pytest.importorskip("torchao", reason='pip install -e ".[quantize]"')

from megalite.inference import SamplingParams, generate_tokens  # noqa: E402
from megalite.inference.quantize import check_quantize, quantize_weights, quantized_linears, weight_bytes  # noqa: E402
from megalite.model.gpt import GPTModel  # noqa: E402
from tests.model.test_gpt_tp import make_config  # noqa: E402

# Per-row symmetric int8 rounds each weight by at most scale/2 = max|w_row|/254: on this model
# (init std 0.02, 2 layers) the logits move by 0.4% (gpt2) and 0.7% (llama) of their largest; 2% of it is the bound.
LOGIT_REL_TOL = 0.02


def model_of(family):
    return GPTModel(make_config(family, max_position_embeddings=40), init_seed=3).eval()


@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_int8_weights_are_int8_and_logits_stay_close(family):
    model = model_of(family)
    tokens = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = model(tokens)
    before = weight_bytes(model)
    linear_bytes = sum(m.weight.numel() * 4 for _, m in quantized_linears(model))
    quantize_weights(model, "int8")
    targets = quantized_linears(model)
    assert len(targets) == 8  # qkv, proj, fc1, fc2 of 2 layers; the output layer is not among them
    for name, module in targets:
        assert type(module.weight).__name__ == "Int8Tensor", name
        assert module.weight.qdata.dtype == torch.int8 and module.weight.qdata.shape == module.weight.shape, name
    if model.output_layer.weight is not None:  # untied (llama); gpt2's is the embedding's
        assert model.output_layer.weight.dtype == torch.float32
    assert model.embedding.word_embeddings.weight.dtype == torch.float32
    # int8 values (1 byte) plus, per row, an fp32 scale and an int8 zero point, instead of 4 bytes per weight
    saved = before - weight_bytes(model)
    rows = sum(m.weight.shape[0] for _, m in targets)
    assert saved == linear_bytes - linear_bytes // 4 - rows * 5, (saved, linear_bytes)
    with torch.no_grad():
        quantized = model(tokens)
    diff = (quantized - reference).abs().max().item()
    scale = reference.abs().max().item()
    assert 0 < diff <= LOGIT_REL_TOL * scale, f"{family}: int8 logits differ by {diff:.2e} (max |logit| {scale:.2e})"


def test_int8_greedy_generation_equals_fp32():
    prompt = [5, 17, 42, 99, 3]
    reference = generate_tokens(model_of("llama"), prompt, 12, SamplingParams(temperature=0))
    model = quantize_weights(model_of("llama"), "int8")
    assert generate_tokens(model, prompt, 12, SamplingParams(temperature=0)) == reference


def test_refusals_are_one_line():
    check_quantize(None, torch.device("cpu"), 4)
    check_quantize("int8", torch.device("cpu"), 1)
    for mode, device, tp, experts, expect in (
            ("int4", "cpu", 1, False, "--quantize int4 needs CUDA"),
            ("int8", "cpu", 2, False, "--quantize int8 runs with TP = 1 only (got TP = 2)"),
            ("int8", "cpu", 1, True, "--quantize int8: the checkpoint's model has MoE experts"),
            ("int2", "cpu", 1, False, "--quantize int2: choose one of int8, int4")):
        with pytest.raises(ValueError) as error:
            check_quantize(mode, torch.device(device), tp, has_experts=experts)
        assert expect in str(error.value) and "\n" not in str(error.value)
