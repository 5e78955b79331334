"""Fixtures of the real-Slurm tests: the cluster (tests/slurm/cluster.py), started once for the
module and stopped at its end whatever happened, and the small corpus, tokenizer and
preprocessed dataset the jobs read."""

import sys
from pathlib import Path

import pytest

from tests.slurm.cluster import SlurmCluster, missing
from tests.training.launch import REPO


@pytest.fixture(scope="module")
def slurm_installed():
    """Skips, saying what is missing, where the cluster cannot run."""
    reason = missing()
    if reason:
        pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_cluster(request, slurm_installed):
    cluster = SlurmCluster()
    request.addfinalizer(cluster.stop)  # registered first: it runs even if start() fails half-way
    cluster.start()
    return cluster


@pytest.fixture
def slurm(slurm_cluster):
    """The cluster, with no job left in its queue after the test."""
    yield slurm_cluster
    slurm_cluster.cancel_all()


@pytest.fixture(scope="module")
def python_bin(tmp_path_factory) -> Path:
    """A folder holding `python` for the jobs' PATH: this interpreter, through a wrapper (a
    symlinked venv interpreter finds no pyvenv.cfg beside it and starts without the venv)."""
    bin_dir = tmp_path_factory.mktemp("bin")
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    return bin_dir


@pytest.fixture(scope="module")
def corpus(tmp_path_factory, python_bin):
    """A JSONL corpus from the standard library, a SentencePiece tokenizer trained on it and the
    corpus preprocessed into Megatron's .bin/.idx (DATA_PATH of the training jobs)."""
    from tests.data.conftest import load_tool

    root = tmp_path_factory.mktemp("corpus")
    jsonl, prefix = root / "corpus.jsonl", root / "tokenizer"
    load_tool("make_demo_corpus").main(["--output", str(jsonl), "--max-mb", "0.3"])
    load_tool("train_tokenizer").main(["--input", str(jsonl), "--json-keys", "text", "--vocab-size", "600",
                                       "--model-prefix", str(prefix)])
    tokenizer = Path(f"{prefix}.model")
    assert load_tool("preprocess_data").main([
        "--input", str(jsonl), "--json-keys", "text", "--output-prefix", str(root / "demo"),
        "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", str(tokenizer), "--append-eod"]) == 0
    return {"jsonl": jsonl, "tokenizer": tokenizer, "data": root / "demo_text_document", "root": root,
            "repo": REPO}
