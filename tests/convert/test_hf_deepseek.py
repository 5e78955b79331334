"""Hugging Face DeepseekV3ForCausalLM (transformers' own class, random tiny configs built here,
nothing downloaded) against megalite: logits within 1e-5 (fp32) with YaRN and mscale, with and
without a query latent, dense and MoE layers (sigmoid group-limited routing with a non-zero
e_score_correction_bias, a shared expert, routed_scaling_factor); through the converter, a
directory holding DeepSeek-V3's MTP layer (layer num_hidden_layers: enorm, hnorm, eh_proj,
shared_head, a MoE layer, the repeated embedding and head) goes HF -> megalite (TP=1, and TP=2
PP=2) -> HF bit for bit, and the converted checkpoint gives transformers' logits."""

import json

import pytest
import torch

from megalite.checkpoint.hf.mapping import config_from_hf, hf_config_dict
from megalite.checkpoint.hf.weights import load_hf_weights
from megalite.model.gpt import GPTModel
from tests.numerics import rel_error

transformers = pytest.importorskip("transformers")
VOCAB, LAYERS = 96, 4
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
        "beta_fast": 32, "beta_slow": 1, "mscale": 0.707, "mscale_all_dim": 0.707}


def deepseek(seed=0, **changes):
    torch.manual_seed(seed)
    fields = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                  num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
                  n_routed_experts=8, routed_scaling_factor=2.5, kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=4,
                  v_head_dim=6, qk_nope_head_dim=8, n_group=4, topk_group=2, num_experts_per_tok=4,
                  first_k_dense_replace=1, max_position_embeddings=64, rope_parameters=YARN, initializer_range=0.1,
                  num_nextn_predict_layers=1, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**{**fields, **changes})).eval()
    with torch.no_grad():  # make the norms and the expert bias matter
        for name, p in [*model.named_parameters(), *model.named_buffers()]:
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            if name.endswith("e_score_correction_bias"):
                p.normal_(0.0, 0.1)
    return model


def tokens(seq=40):
    return torch.randint(0, VOCAB, (2, seq), generator=torch.Generator().manual_seed(3))


VARIANTS = {
    "yarn-moe": {},
    "no-query-latent-rope": dict(q_lora_rank=None, rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    "dense-tied": dict(first_k_dense_replace=LAYERS, tie_word_embeddings=True),
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_logits_match_transformers(variant):
    hf = deepseek(**VARIANTS[variant])
    config = config_from_hf(hf.config).replace(mtp_num_layers=None)
    assert config_from_hf(hf_config_dict(config)).replace(mtp_num_layers=None) == config
    model = GPTModel(config).eval()
    load_hf_weights(model, hf.state_dict())
    with torch.no_grad():
        assert rel_error(model(tokens())[..., :VOCAB], hf(tokens()).logits) < 1e-5


def _mtp_tensors(hf) -> dict:
    """DeepSeek-V3's MTP layer as its files hold it: a decoder layer (here a MoE one, drawn as
    transformers draws layer 1) numbered num_hidden_layers, its own norms and projection, and
    copies of the embedding and the head."""
    from megalite.checkpoint.hf.mapping_deepseek import split_fused_deepseek_experts

    state = split_fused_deepseek_experts(hf.state_dict())  # per-expert tensors, as the files hold them
    layer = f"model.layers.{LAYERS}."
    g = torch.Generator().manual_seed(5)
    out = {}
    for name, tensor in state.items():
        if name.startswith("model.layers.1."):
            out[layer + name[len("model.layers.1."):]] = torch.randn(tensor.shape, generator=g, dtype=tensor.dtype) * 0.1
    h = hf.config.hidden_size
    out[layer + "enorm.weight"], out[layer + "hnorm.weight"] = torch.rand(h, generator=g) + 0.5, torch.rand(h, generator=g) + 0.5
    out[layer + "eh_proj.weight"] = torch.randn(h, 2 * h, generator=g) * 0.1
    out[layer + "shared_head.norm.weight"] = torch.rand(h, generator=g) + 0.5
    out[layer + "embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
    out[layer + "shared_head.head.weight"] = state["lm_head.weight"].clone()
    return out


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """transformers' save_pretrained directory with the MTP layer's tensors added."""
    from safetensors.torch import load_file, save_file

    hf = deepseek()
    directory = tmp_path_factory.mktemp("deepseek")
    hf.save_pretrained(directory)
    (weights,) = directory.glob("*.safetensors")
    tensors = load_file(weights)
    tensors.update(_mtp_tensors(hf))
    save_file(tensors, weights, metadata={"format": "pt"})
    return directory, hf


@pytest.mark.parametrize("tp, pp", [(1, 1), (2, 2)])
def test_converter_round_trip_is_bit_identical(hf_dir, tmp_path, tp, pp):
    from safetensors.torch import load_file

    from tests.convert.hf_models import hf_to_megalite, megalite_to_hf

    directory, _ = hf_dir
    megalite_to_hf(hf_to_megalite(directory, tmp_path / "ml", tp=tp, pp=pp), tmp_path / "back")
    (source,) = directory.glob("*.safetensors")
    source, back = load_file(source), {}
    for path in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(path))
    assert sorted(set(source) ^ set(back)) == []
    assert [n for n, t in source.items() if not torch.equal(back[n], t)] == []
    assert json.loads((tmp_path / "back" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    assert any(".mlp.experts.7." in n and n.startswith(f"model.layers.{LAYERS}.") for n in source)


def test_converted_checkpoint_gives_transformers_logits(hf_dir, tmp_path):
    from megalite.checkpoint.dcp.checkpoint import load_checkpoint
    from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
    from tests.convert.hf_models import hf_to_megalite

    directory, hf = hf_dir
    converted = hf_to_megalite(directory, tmp_path / "ml")
    config = MegaliteCheckpoint(converted).config
    assert config.mtp_num_layers == 1 and config.mla.rope_type == "yarn"
    model = GPTModel(config, init_seed=9).eval()
    load_checkpoint(converted, chunks=[model], pstate=model.pstate, load_rng=False)
    with torch.no_grad():
        assert rel_error(model(tokens())[..., :VOCAB], hf(tokens()).logits) < 1e-5
    bias = hf.state_dict()["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert torch.equal(model.layers["1"].mlp.router.expert_bias, bias)
