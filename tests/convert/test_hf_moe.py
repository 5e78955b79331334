"""Hugging Face Mixtral, Qwen2-MoE and Qwen3-MoE (random small configs) against megalite: logits
within 1e-4 at EP = 1 and at EP = 2 (two gloo processes); Hugging Face -> megalite at EP = 2, PP = 2
(four processes, experts gathered over EP, layers over PP) -> Hugging Face is bit-identical,
as is the converter's hf -> megalite (PP = 2) -> hf. Qwen3-MoE's routing (norm_topk_prob) and
dense-layer choice (decoder_sparse_step, mlp_only_layers) are checked against transformers in
both settings."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

from megalite.model.gpt import GPTModel
from megalite.checkpoint.hf.mapping import config_from_hf, hf_config_dict, megalite_to_hf
from megalite.checkpoint.hf.mapping_moe import split_fused_experts
from megalite.model.pipeline_chunks import build_model_chunks
from megalite.checkpoint.hf.weights import load_hf_weights
from megalite.model.weights import gather_full_weights
from megalite.parallel.expert.groups import ExpertState
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.convert.hf_moe_models import MOE_FAMILIES, VOCAB, hf_moe_model, tokens
from tests.distributed import run_distributed
from tests.numerics import rel_error

pytest.importorskip("transformers")


def _megalite_logits(family, pstate):
    hf = hf_moe_model(family)
    config = config_from_hf(hf.config)
    model = GPTModel(config, pstate).eval()
    load_hf_weights(model, hf.state_dict())
    with torch.no_grad():
        return model(tokens())[..., :VOCAB], hf(tokens()).logits


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_logits_match_transformers_ep1(family):
    ours, theirs = _megalite_logits(family, ParallelState.single())
    assert rel_error(ours, theirs) < 1e-4
    config = config_from_hf(hf_moe_model(family).config)
    assert config.moe.num_experts == 4 and config_from_hf(hf_config_dict(config)) == config
    if family == "qwen2_moe":
        assert config.moe.layer_pattern(4) == [0, 1, 1, 1] and config.moe.pre_softmax
    if family == "qwen3_moe":
        assert config.qk_layernorm and config.kv_channels == 16 and not config.moe.pre_softmax
        assert config.moe.layer_pattern(4) == [1, 1, 0, 1] and config.moe.shared_expert_intermediate_size is None
        import transformers

        # config.json as megalite writes it builds the same transformers config (num_experts alias included)
        assert config_from_hf(transformers.Qwen3MoeConfig(**hf_config_dict(config))) == config


def test_qwen3_moe_routing_and_sparse_step_match_transformers():
    """norm_topk_prob off (softmax before top-k, no renormalisation) and decoder_sparse_step 2 with
    mlp_only_layers: megalite matches transformers, and each setting changes the logits."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    hf = hf_moe_model("qwen3_moe", num_layers=6, norm_topk_prob=False, decoder_sparse_step=2, mlp_only_layers=[3])
    config = config_from_hf(hf.config)
    assert config.moe.layer_pattern(6) == [int(isinstance(layer.mlp, Qwen3MoeSparseMoeBlock)) for layer in hf.model.layers]
    assert config.moe.layer_pattern(6) == [0, 1, 0, 0, 0, 1] and config.moe.pre_softmax
    assert config_from_hf(hf_config_dict(config)) == config
    model = GPTModel(config, ParallelState.single()).eval()
    load_hf_weights(model, hf.state_dict())
    flipped = GPTModel(config.replace(moe=dataclasses.replace(config.moe, pre_softmax=False))).eval()
    load_hf_weights(flipped, hf.state_dict())
    with torch.no_grad():
        theirs, ours, other = hf(tokens()).logits, model(tokens())[..., :VOCAB], flipped(tokens())[..., :VOCAB]
    assert rel_error(ours, theirs) < 1e-4
    assert rel_error(other, theirs) > 1e-2


def test_qwen3_moe_refusals():
    config = config_from_hf(hf_moe_model("qwen3_moe", num_layers=2).config)
    with pytest.raises(ValueError, match="attention_bias"):
        config_from_hf({**hf_config_dict(config), "attention_bias": True})
    with pytest.raises(ValueError, match="num_experts"):
        config_from_hf({**hf_config_dict(config), "num_experts": 0})
    shared = dataclasses.replace(config.moe, shared_expert_intermediate_size=8, shared_expert_gate=True)
    with pytest.raises(ValueError, match="qk_layernorm"):
        hf_config_dict(config.replace(moe=shared))


def _worker(rank, world, pp, tp=1, etp=None):
    pstate = ParallelState.create(ParallelLayout(world, pipeline=pp, tensor=tp))
    pstate.expert = ExpertState.create(pstate, 2, num_experts=4, expert_tensor_size=etp)
    out = {}
    for family in MOE_FAMILIES:
        if pp == 1 and tp == 1:
            ours, theirs = _megalite_logits(family, pstate)
            out[family] = rel_error(ours, theirs)
            continue
        hf = hf_moe_model(family)
        config = config_from_hf(hf.config)
        (chunk,) = build_model_chunks(config, pstate)
        load_hf_weights(chunk, hf.state_dict())
        held = [None] * world
        dist.all_gather_object(held, gather_full_weights(chunk))
        full = {name: t for part in held for name, t in part.items()}
        exported = dict(megalite_to_hf(full.__getitem__, config))
        on_disk = split_fused_experts(hf.state_dict(), config)
        out[family] = sorted(n for n, t in on_disk.items() if not (n in exported and torch.equal(exported[n], t))) + \
            sorted(set(exported) - set(on_disk))
    return out


@pytest.mark.slow  # ten processes importing transformers: about 150 s on 2 cores
def test_ep2_logits_and_ep2_pp2_round_trip():
    for result in run_distributed(_worker, 2, 1):
        assert all(err < 1e-4 for err in result.values()), result
    for result in run_distributed(_worker, 4, 2):
        assert result == {f: [] for f in MOE_FAMILIES}
    for result in run_distributed(_worker, 4, 1, 2, 1):  # TP = 2, whole experts (ETP = 1), EP = 2
        assert result == {f: [] for f in MOE_FAMILIES}


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_converter_round_trip_is_bit_identical(tmp_path, family):
    from safetensors.torch import load_file

    from tests.convert.hf_models import hf_to_megalite, megalite_to_hf as export, save_hf

    hf = hf_moe_model(family)
    source = save_hf(hf, tmp_path / "hf")
    export(hf_to_megalite(source, tmp_path / "ml", pp=2), tmp_path / "back")
    source_tensors, back = load_file(tmp_path / "hf" / "model.safetensors"), {}
    for path in (tmp_path / "back").glob("*.safetensors"):
        back.update(load_file(path))
    assert set(back) == set(source_tensors)
    assert all(torch.equal(back[n], t) for n, t in source_tensors.items())
    assert len(source_tensors) > 40  # per-expert tensors, as the files hold them
