"""gigatoken in preprocessing: used only where its ids equal the tokenizer's own, the same
bytes written either way, and everything works with gigatoken hidden (as if not installed)."""

import builtins
import json
import os

import numpy as np
import pytest

from megalite.data import gigatoken_encoder as gte
from megalite.data.preprocess import PreprocessConfig, preprocess
from megalite.data.tokenizers import build_tokenizer


def hide_gigatoken(monkeypatch):
    real_import = builtins.__import__

    def no_gigatoken(name, *args, **kwargs):
        if name == "gigatoken" or name.startswith("gigatoken."):
            raise ImportError("No module named 'gigatoken' (hidden by the test)")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_gigatoken)


@pytest.fixture
def tokenizer_args(request, sp_model, gpt2_files):
    return {"sp": dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model),
            "gpt2": dict(tokenizer_type="GPT2BPETokenizer", vocab_file=gpt2_files[0], merge_file=gpt2_files[1]),
            "hf": dict(tokenizer_type="HuggingFaceTokenizer", tokenizer_model=gpt2_files[2])}[request.param]


def run(tmp_path, corpus, name, tokenizer_args, **options):
    log = tmp_path / f"{name}.log"
    with open(log, "w") as stream:
        preprocess(PreprocessConfig(input=[corpus], output_prefix=str(tmp_path / name), append_eod=True,
                                    **tokenizer_args, **options), stream=stream)
    prefix = tmp_path / f"{name}_text_document"
    return [open(f"{prefix}{ext}", "rb").read() for ext in (".bin", ".idx")], log.read_text().splitlines()


@pytest.mark.parametrize("tokenizer_args", ["sp", "gpt2", "hf"], indirect=True)
def test_gigatoken_gives_the_tokenizers_ids_and_the_same_dataset(tmp_path, demo_corpus, demo_texts, tokenizer_args,
                                                                 monkeypatch):
    pytest.importorskip("gigatoken")  # the run without it is test_everything_works_with_gigatoken_hidden
    tok = build_tokenizer(**tokenizer_args)
    options = {k: v for k, v in tokenizer_args.items() if k != "tokenizer_type"}
    encoder, why = gte.gigatoken_encoder(tok, tokenizer_args["tokenizer_type"], **options)
    assert encoder is not None, why
    assert encoder.encode_batch_bytes(demo_texts) == tok.encode_batch_bytes(demo_texts)
    special = ["x </s> y <s> z <pad> <|endoftext|>", "plain"]  # special-token strings in text read as text
    assert encoder.encode_batch_bytes(special) == tok.encode_batch_bytes(special)
    fast, fast_log = run(tmp_path, demo_corpus, "fast", tokenizer_args, workers=2)
    assert fast_log[0].startswith(f"tokenising with gigatoken ") and "ids checked against" in fast_log[0], fast_log
    library, library_log = run(tmp_path, demo_corpus, "library", tokenizer_args, use_gigatoken=False)
    assert library_log[0] == (f"tokenising with {tokenizer_args['tokenizer_type']}'s own library path "
                              "(gigatoken is turned off)"), library_log
    assert fast == library
    hide_gigatoken(monkeypatch)
    hidden, hidden_log = run(tmp_path, demo_corpus, "hidden", tokenizer_args, workers=2)
    assert "(gigatoken is not installed)" in hidden_log[0], hidden_log
    assert hidden == library


def test_other_ids_on_a_probe_or_the_input_keep_the_library_path(tmp_path, demo_corpus, demo_texts, sp_model,
                                                                  monkeypatch):
    pytest.importorskip("gigatoken")
    args = dict(tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model)
    real = gte.GigatokenEncoder.encode_batch_bytes
    marker = demo_texts[0][:30]

    def off_by_one_on(text_part):
        def encode(self, texts):
            out = real(self, texts)
            return [b[:-4] + (np.frombuffer(b[-4:], np.int32) + 1).tobytes() if text_part in t and b else b
                    for t, b in zip(texts, out)]
        return encode

    library, _ = run(tmp_path, demo_corpus, "library", args, use_gigatoken=False)
    for name, text_part in (("probe", "café"), ("input", marker)):  # a probe text; the input's first document
        monkeypatch.setattr(gte.GigatokenEncoder, "encode_batch_bytes", off_by_one_on(text_part))
        out, log = run(tmp_path, demo_corpus, name, args)
        assert log[0].startswith("tokenising with SentencePieceTokenizer's own library path (gigatoken ")
        assert "gives other ids than SentencePieceTokenizer for" in log[0], log
        assert out == library


def test_tiktoken_keeps_its_library_path(tiktoken_file):
    tok = build_tokenizer("TikTokenizer", tokenizer_model=tiktoken_file, tiktoken_num_special_tokens=10)
    encoder, why = gte.gigatoken_encoder(tok, "TikTokenizer", tokenizer_model=tiktoken_file)
    assert encoder is None and why in ("gigatoken is not installed",
                                       "gigatoken does not carry TikTokenizer's pre-tokenisation"), why


def test_gpt2_tokenizer_json_is_the_files(gpt2_files):
    """The tokenizer.json built for gigatoken from vocab.json + merges.txt holds them as they are."""
    spec = json.loads(gte._gpt2_tokenizer_json(gpt2_files[0], gpt2_files[1]))
    with open(gpt2_files[0], encoding="utf-8") as f:
        assert spec["model"]["vocab"] == json.load(f)
    with open(gpt2_files[1], encoding="utf-8") as f:
        merges = [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#version")]
    assert spec["model"]["merges"] == merges and len(merges) > 100
    assert os.path.isfile(gpt2_files[1])
