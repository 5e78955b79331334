"""Shared fixtures for the data tests: a small demo corpus and tiny tokenizer files of every
kind, all built locally (nothing is downloaded)."""

import base64
import importlib.util
import json
import os
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_tool(name: str):
    """Import tools/<name>.py as a module (tools/ is not a package)."""
    spec = importlib.util.spec_from_file_location(f"tool_{name}", os.path.join(REPO, "tools", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("data")


@pytest.fixture(scope="session")
def demo_corpus(data_dir):
    """About 0.6 MB of JSONL from the standard library (tools/make_demo_corpus.py)."""
    path = str(data_dir / "demo.jsonl")
    load_tool("make_demo_corpus").main(["--output", path, "--max-mb", "0.6"])
    return path


@pytest.fixture(scope="session")
def demo_texts(demo_corpus):
    with open(demo_corpus, encoding="utf-8") as f:
        return [json.loads(line)["text"] for line in f]


@pytest.fixture(scope="session")
def sp_model(data_dir, demo_corpus):
    """A 600-piece SentencePiece BPE model trained by tools/train_tokenizer.py."""
    prefix = str(data_dir / "sp")
    load_tool("train_tokenizer").main(["--input", demo_corpus, "--vocab-size", "600", "--model-prefix", prefix])
    return prefix + ".model"


@pytest.fixture(scope="session")
def gpt2_files(data_dir, demo_texts):
    """(vocab.json, merges.txt, tokenizer.json) of a 600-entry byte-level BPE trained with
    the `tokenizers` library; <|endoftext|> is id 0."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(demo_texts[:200], trainer)
    out = data_dir / "gpt2"
    out.mkdir()
    vocab, merges = tok.model.save(str(out))
    tok.save(str(out / "tokenizer.json"))
    return vocab, merges, str(out / "tokenizer.json")


@pytest.fixture(scope="session")
def tiktoken_file(data_dir, gpt2_files):
    """A tiktoken rank file ('base64 rank' lines) with the byte-level BPE's tokens as ranks."""
    from megalite.data.gpt2_bpe import bytes_to_unicode

    decoder = {c: b for b, c in bytes_to_unicode().items()}
    with open(gpt2_files[0], encoding="utf-8") as f:
        vocab = json.load(f)
    tokens = sorted((i, t) for t, i in vocab.items() if t != "<|endoftext|>")
    path = str(data_dir / "tiny.tiktoken")
    with open(path, "w") as f:
        for rank, (_, token) in enumerate(tokens):
            f.write(f"{base64.b64encode(bytes(decoder[c] for c in token)).decode()} {rank}\n")
    return path


def run_python(args, **kwargs):
    import subprocess

    return subprocess.run([sys.executable, *args], capture_output=True, text=True, cwd=REPO, **kwargs)
