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


def test_int4_on_cuda_needs_compute_capability_8(monkeypatch):
    """The decision on CUDA: tinygemm's tensor-core kernel needs sm_80 or newer (torchao raises deep
    inside quantize_ otherwise); the GPU's capability is asked of the device given."""
    from megalite.inference import quantize

    asked = []
    monkeypatch.setattr(quantize, "cuda_capability", lambda device: asked.append(device) or capability)
    capability = (9, 0)
    check_quantize("int4", torch.device("cuda", 1), 1)
    assert asked == [torch.device("cuda", 1)]
    capability = (7, 5)
    with pytest.raises(ValueError) as error:
        check_quantize("int4", torch.device("cuda", 0), 1)
    assert "compute capability 8.0 or newer" in str(error.value) and "cuda:0 has 7.5" in str(error.value)
    assert "\n" not in str(error.value)
    check_quantize("int8", torch.device("cuda", 0), 1)  # INT8 asks nothing of the GPU


def test_int4_config_is_tinygemm_tile_packed_groups_of_128():
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig

    from megalite.inference.quantize import quantize_config

    config = quantize_config("int4")
    assert isinstance(config, Int4WeightOnlyConfig) and config.group_size == 128 and config.version == 2
    assert config.int4_packing_format == "tile_packed_to_4d" and config.int4_choose_qparams_algorithm == "tinygemm"
    assert config.set_inductor_config is False
    assert isinstance(quantize_config("int8"), Int8WeightOnlyConfig)


def test_int4_casts_to_bf16_and_gives_quantize_the_linears_and_config(monkeypatch):
    """Without a GPU: what quantize_weights hands torchao for INT4 (quantize_ recorded, not run)."""
    import torchao.quantization

    calls = []
    monkeypatch.setattr(torchao.quantization, "quantize_", lambda model, config, filter_fn: calls.append(
        (config, [name for name, module in model.named_modules() if filter_fn(module, name)])))
    model = GPTModel(make_config("llama", hidden_size=128, ffn_hidden_size=256, max_position_embeddings=40), init_seed=3)
    assert quantize_weights(model, "int4") is model
    (config, chosen), = calls
    assert config.int4_packing_format == "tile_packed_to_4d" and config.group_size == 128
    assert chosen == [name for name, _ in quantized_linears(model)] and len(chosen) == 8
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    with pytest.raises(ValueError) as error:  # torchao would skip such a weight silently
        quantize_weights(model_of("llama"), "int4")
    assert "input width 64 is not a multiple of the group size 128" in str(error.value)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="INT4 (tinygemm) needs CUDA")
def test_int4_on_cuda_packs_the_weights_and_logits_stay_close():
    """On a GPU (gpu_check.sh's tests-tp-cuda step): INT4 weights in tinygemm's packed layout, the
    logits within 10% of the bf16 model's largest (4 bits, groups of 128), greedy generation runs."""
    config = make_config("llama", hidden_size=128, ffn_hidden_size=256, max_position_embeddings=40)
    model = GPTModel(config, init_seed=3, device=torch.device("cuda")).eval().to(torch.bfloat16)
    check_quantize("int4", torch.device("cuda"), 1)
    tokens = torch.randint(0, 250, (2, 24), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        reference = model(tokens).float()
    before = weight_bytes(model)
    quantize_weights(model, "int4")
    for name, module in quantized_linears(model):
        assert type(module.weight).__name__ == "Int4TilePackedTo4dTensor", name
    assert weight_bytes(model) < before
    with torch.no_grad():
        quantized = model(tokens).float()
    diff, scale = (quantized - reference).abs().max().item(), reference.abs().max().item()
    assert 0 < diff <= 0.1 * scale, f"int4 logits differ by {diff:.2e} (max |logit| {scale:.2e})"
    assert len(generate_tokens(model, [5, 17, 42], 6, SamplingParams(temperature=0))) == 6
