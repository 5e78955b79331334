"""Hugging Face -> megalite (TP=2, PP=2) -> Hugging Face returns bit-identical tensors for GPT-2
and Llama (GQA, tied and untied), from safetensors (single and sharded) and PyTorch weights;
megalite -> megalite at other layouts keeps every tensor; the checkpoint is what a run at the
target layout describes to DCP."""

import json
from pathlib import Path

import pytest
import torch

from megalite.checkpoint.megalite_reader import MegaliteCheckpoint
from megalite.checkpoint.hf.safetensors_io import read_header
from megalite.model.gpt import GPTModel
from megalite.checkpoint.dcp.checkpoint import iteration_dir, load_checkpoint
from tests.convert.hf_models import (FAMILIES, convert, hf_model, hf_to_megalite, megalite_to_hf, save_hf,
                                     write_gpt2_bpe_files)

transformers = pytest.importorskip("transformers")


def _assert_identical(reference: dict, directory, family: str):
    back = transformers.AutoModelForCausalLM.from_pretrained(directory).state_dict()
    assert set(back) == set(reference), f"{family}: names differ: {set(back) ^ set(reference)}"
    for name, tensor in reference.items():
        assert back[name].dtype == tensor.dtype and torch.equal(back[name], tensor), f"{family}: {name} differs"


CASES = [("gpt2", {}), ("llama", {}), ("llama", {"tied": True})]


@pytest.mark.parametrize("family, options", CASES, ids=["gpt2", "llama-gqa", "llama-tied"])
def test_hf_megalite_tp2_pp2_hf_is_bit_identical(tmp_path, family, options):
    model = hf_model(family, **options)
    ckpt = hf_to_megalite(save_hf(model, tmp_path / "hf"), tmp_path / "ml", tp=2, pp=2)
    megalite_to_hf(ckpt, tmp_path / "back")
    _assert_identical(model.state_dict(), tmp_path / "back", family)
    common = json.loads((iteration_dir(ckpt, 0) / "common.json").read_text())
    assert common["layout"] == {"tp": 2, "pp": 2, "dp": 1, "vp": 1} and common["iteration"] == 0
    assert sorted(p.name for p in iteration_dir(ckpt, 0).glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    assert set(common["files"]) == {p.name for p in iteration_dir(ckpt, 0).iterdir()} - {"common.json"}


def test_sharded_safetensors_and_pytorch_bin_inputs(tmp_path):
    model = hf_model("llama", seed=1)
    sharded = save_hf(model, tmp_path / "sharded", max_shard_size="100KB")
    assert (Path(sharded) / "model.safetensors.index.json").exists()
    ckpt = hf_to_megalite(sharded, tmp_path / "from_sharded", tp=2)
    megalite_to_hf(ckpt, tmp_path / "back1")
    _assert_identical(model.state_dict(), tmp_path / "back1", "llama (sharded input)")
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (tmp_path / "pytorch_model.bin").rename(bin_dir / "pytorch_model.bin")
    (bin_dir / "config.json").write_text((Path(sharded) / "config.json").read_text())
    megalite_to_hf(hf_to_megalite(bin_dir, tmp_path / "from_bin", pp=2), tmp_path / "back2")
    _assert_identical(model.state_dict(), tmp_path / "back2", "llama (pytorch_model.bin input)")


def test_sharded_safetensors_output(tmp_path):
    model = hf_model("gpt2", seed=2)
    ckpt = hf_to_megalite(save_hf(model, tmp_path / "hf"), tmp_path / "ml")
    megalite_to_hf(ckpt, tmp_path / "back", "--max-shard-size", "100KB")
    index = json.loads((tmp_path / "back" / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and all(s.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    sizes = [sum(e["data_offsets"][1] - e["data_offsets"][0] for e in read_header(tmp_path / "back" / s)[0].values())
             for s in shards]
    assert index["metadata"]["total_size"] == sum(sizes)
    _assert_identical(model.state_dict(), tmp_path / "back", "gpt2 (sharded output)")


@pytest.mark.parametrize("family", FAMILIES)
def test_megalite_to_megalite_relayout(tmp_path, family):
    """TP=2 PP=2 -> TP=1 PP=4 VP=... -> TP=2 PP=1: every tensor identical; loads at TP=1."""
    model = hf_model(family, seed=3)
    first = hf_to_megalite(save_hf(model, tmp_path / "hf"), tmp_path / "a", tp=2, pp=2)
    status = convert("--loader", "megalite", "--saver", "megalite", "--load-dir", first, "--save-dir", tmp_path / "b",
                     "--target-tensor-parallel-size", 1, "--target-pipeline-parallel-size", 2,
                     "--target-num-virtual-stages", 2)
    assert status == 0
    status = convert("--loader", "megalite", "--saver", "megalite", "--load-dir", tmp_path / "b",
                     "--save-dir", tmp_path / "c", "--target-tensor-parallel-size", 2,
                     "--target-pipeline-parallel-size", 1)
    assert status == 0
    a, c = MegaliteCheckpoint(first), MegaliteCheckpoint(tmp_path / "c")
    assert a.keys() == c.keys()
    for key in a.keys():
        assert torch.equal(a.get(key), c.get(key)), f"{family}: {key} changed"
    assert MegaliteCheckpoint(tmp_path / "b").common["layout"] == {"tp": 1, "pp": 2, "dp": 1, "vp": 2}
    assert c.common["args"]["tensor_model_parallel_size"] == 2 and c.common["args"]["pipeline_model_parallel_size"] == 1
    chunk = GPTModel(c.config.replace(params_dtype="float32"), init_seed=5)
    load_checkpoint(tmp_path / "c", chunks=[chunk], pstate=chunk.pstate)
    for name, param in chunk.named_parameters():
        assert torch.equal(param.data[: a.spec(f"model/{name}")[0][0]], a.get_model(name)), name


def test_gpt2_saved_from_the_base_model(tmp_path, capsys):
    """Hub GPT-2 checkpoints name tensors without 'transformer.' and carry attn.bias buffers."""
    from safetensors.torch import save_file

    model = hf_model("gpt2", seed=5)
    state = {n.removeprefix("transformer."): t.clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}
    state["h.0.attn.bias"] = torch.ones(1, 1, 8, 8)
    (tmp_path / "hub").mkdir()
    save_file(state, tmp_path / "hub" / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path / "hub")
    megalite_to_hf(hf_to_megalite(tmp_path / "hub", tmp_path / "ml", tp=2), tmp_path / "back")
    assert "not used" not in capsys.readouterr().out
    _assert_identical(model.state_dict(), tmp_path / "back", "gpt2 (base-model names)")


def test_tensors_megalite_has_no_place_for_are_refused(tmp_path, capsys):
    from safetensors.torch import save_file

    model = hf_model("llama", seed=6)
    state = {n: t.clone() for n, t in model.state_dict().items()}
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)  # a feature megalite lacks
    (tmp_path / "hf").mkdir()
    save_file(state, tmp_path / "hf" / "model.safetensors", metadata={"format": "pt"})
    model.config.save_pretrained(tmp_path / "hf")
    status = convert("--loader", "hf", "--saver", "megalite", "--load-dir", tmp_path / "hf", "--save-dir", tmp_path / "ml")
    err = capsys.readouterr().err.strip()
    assert status == 2 and err == (f"convert: error: {tmp_path / 'hf' / 'model.safetensors'}: tensor "
                                   "model.layers.0.self_attn.q_norm.weight has no place in megalite's llama model"), err
    assert list(tmp_path.iterdir()) == [tmp_path / "hf"], "output left behind"


def test_gpt2_bpe_tokenizer_files_travel_both_ways(tmp_path, capsys):
    """vocab.json + merges.txt beside a GPT-2 model become the checkpoint's GPT2BPETokenizer and
    come back with the export, with a tokenizer_config.json that makes transformers encode as
    megalite does; config.json names the end-of-document token."""
    from megalite.data.tokenizers import build_tokenizer

    hf_dir = Path(save_hf(hf_model("gpt2", seed=7), tmp_path / "hf"))
    write_gpt2_bpe_files(hf_dir)
    ckpt = Path(hf_to_megalite(hf_dir, tmp_path / "ml", tp=2))
    entry = MegaliteCheckpoint(ckpt).common["tokenizer"]
    assert entry == {"type": "GPT2BPETokenizer", "model": None, "vocab_file": str(ckpt / "tokenizer" / "vocab.json"),
                     "merge_file": str(ckpt / "tokenizer" / "merges.txt")}
    back = Path(megalite_to_hf(ckpt, tmp_path / "back"))
    assert "tokenizer files copied: vocab.json, merges.txt, tokenizer_config.json" in capsys.readouterr().out
    for name in ("vocab.json", "merges.txt"):
        assert (back / name).read_bytes() == (hf_dir / name).read_bytes(), name
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=str(back / "vocab.json"), merge_file=str(back / "merges.txt"))
    theirs = transformers.AutoTokenizer.from_pretrained(back)
    text = "the quick brown fox, hello megalite!\n  Ünïcode 123 jumps over  the dog "
    ids = ours.encode(text)
    assert len(ids) < len(text.encode()), "the merges were not applied"
    assert theirs(text, add_special_tokens=False)["input_ids"] == ids
    assert theirs.decode(ids) == ours.decode(ids) == text
    config = json.loads((back / "config.json").read_text())
    assert ours.eod == 0 and config["eos_token_id"] == config["bos_token_id"] == ours.eod
