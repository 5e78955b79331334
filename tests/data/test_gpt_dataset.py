"""GPT samples: Megatron-Core's arrays and samples, label coverage, seeding, caching, masks."""

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from megalite.data import build_gpt_datasets
from megalite.data.gpt_dataset import GPTDataset, ltor_masks
from megalite.data.gpt_index import build_gpt_indices, build_sample_index, parse_split, split_ranges
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from tests.data.conftest import REPO

EOD = 0


def write_dataset(prefix, lengths, seed=0, unique=False, dtype=np.int32):
    """Documents of the given lengths ending in EOD; with unique=True every token id is
    distinct (ids 1, 2, ..., eod excepted), so a token identifies its position."""
    rng = np.random.default_rng(seed)
    next_id = 1
    with IndexedDatasetWriter(str(prefix), dtype) as w:
        for n in lengths:
            if unique:
                doc = np.arange(next_id, next_id + n, dtype=np.int64)
                next_id += n
            else:
                doc = rng.integers(1, 1000, n)
                if n:
                    doc[-1] = EOD
            w.add_document(doc)
    return str(prefix)


def test_index_arrays_equal_megatron_helpers_and_shuffles():
    from megatron.core.datasets import helpers
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index

    rng = np.random.default_rng(0)
    for case in range(120):
        n = int(rng.integers(1, 150))
        sizes = rng.integers(0, int(rng.integers(2, 60)), n).astype(np.int32)
        if case % 3 == 0:
            sizes[rng.integers(0, n, n // 3)] = 0  # empty documents, including possibly the first
        seq = int(rng.integers(1, 50))
        tokens = int(sizes.sum())
        if tokens < 2 or (tokens - 1) // seq < 1:
            continue
        num_samples = int(rng.integers(1, 4 * tokens // seq + 2))
        ours = build_gpt_indices(sizes, np.arange(n), num_samples, seq, seed=case)
        # Megatron-Core's GPTDataset steps, with its compiled helper
        epochs = max(1, -(-(num_samples * seq + 1) // tokens))
        per_epoch = (tokens - 1) // seq
        before_final = ((epochs - 1) * tokens - 1) // seq
        separate = epochs > 1 and num_samples - before_final < int(0.8 * per_epoch)
        state = np.random.RandomState(case)
        doc_index = _build_document_index(np.arange(n, dtype=np.int32), epochs, state, separate)
        sample_index = helpers.build_sample_idx(sizes, doc_index, seq, epochs, tokens, True, True)
        total = sample_index.shape[0] - 1
        shuffle = _build_shuffle_index(before_final if separate else total, total, state)
        for name, theirs in (("document_index", doc_index), ("sample_index", sample_index),
                             ("shuffle_index", shuffle)):
            assert ours[name].dtype == theirs.dtype and np.array_equal(ours[name], theirs), (case, name)
        assert np.array_equal(build_sample_index(sizes, doc_index, seq, epochs, tokens), sample_index)


class _MegatronTokenizer:
    eod, pad, vocab_size = EOD, -1, 1000
    unique_identifiers = {"class": "test"}


def test_samples_equal_megatron_core_gpt_dataset(tmp_path):
    from megatron.core.datasets import blended_megatron_dataset_builder as builder_mod
    from megatron.core.datasets.gpt_dataset import GPTDataset as MegatronGPTDataset
    from megatron.core.datasets.gpt_dataset import GPTDatasetConfig

    lengths = np.random.default_rng(1).integers(1, 90, 700)
    prefix = write_dataset(tmp_path / "corpus", lengths)
    num_samples = [300, 40, 5]
    flags = dict(reset_position_ids=True, reset_attention_mask=True, eod_mask_loss=True)
    config = GPTDatasetConfig(random_seed=77, sequence_length=32, blend=([prefix], None), split="90,8,2",
                              tokenizer=_MegatronTokenizer(), path_to_cache=str(tmp_path / "mc"), **flags)
    theirs = builder_mod.BlendedMegatronDatasetBuilder(MegatronGPTDataset, num_samples, lambda: True, config).build()
    ours = build_gpt_datasets(data_path=[prefix], split="90,8,2", seq_length=32, seed=77, num_samples=num_samples,
                              eod_token=EOD, vocab_size=1000, cache_path=str(tmp_path / "ml"), **flags)
    for split, (a, b) in enumerate(zip(ours, theirs)):
        assert len(a) == len(b)
        for i in range(0, len(a), 3):
            x, y = a[i], b[i]
            for key in ("tokens", "labels", "loss_mask", "position_ids", "attention_mask"):
                assert np.array_equal(x[key], y[key].numpy()), (split, i, key)


def test_every_token_is_a_label_once_per_epoch_and_seeds_matter(tmp_path):
    lengths = np.random.default_rng(2).integers(1, 120, 400)
    prefix = write_dataset(tmp_path / "unique", lengths, unique=True)
    indexed = IndexedDataset(prefix)
    seq = 50
    ds = GPTDataset(indexed, np.arange(len(indexed)), None, seq, seed=5, eod=EOD)
    labels = np.concatenate([ds[i]["labels"] for i in range(len(ds))])
    order = np.concatenate([indexed[int(d)] for d in ds.document_index])
    # the stream's first token starts sample 0 and is never a label; after the last full
    # sample fewer than seq tokens remain
    assert len(labels) == len(ds) * seq and len(order) - 1 - len(labels) < seq
    assert np.array_equal(np.sort(labels), np.sort(order[1:1 + len(labels)]))
    assert len(np.unique(labels)) == len(labels)  # no token is a label twice
    for i in range(len(ds)):  # labels are the tokens shifted by one, within each sample
        item = ds[i]
        assert np.array_equal(item["tokens"][1:], item["labels"][:-1])
    same = GPTDataset(indexed, np.arange(len(indexed)), None, seq, seed=5, eod=EOD)
    other = GPTDataset(indexed, np.arange(len(indexed)), None, seq, seed=6, eod=EOD)
    assert all(np.array_equal(ds[i]["tokens"], same[i]["tokens"]) for i in range(len(ds)))
    assert sum(np.array_equal(ds[i]["tokens"], other[i]["tokens"]) for i in range(len(ds))) < len(ds) // 10


def sample_digest(dataset, count=40):
    h = hashlib.sha256()
    for i in range(min(count, len(dataset))):
        h.update(dataset[i]["tokens"].tobytes())
    return h.hexdigest()


BUILD_IN_SUBPROCESS = """
import hashlib, sys
from megalite.data import build_gpt_datasets
train, _, _ = build_gpt_datasets(data_path=[sys.argv[1]], split="1", seq_length=16, seed=9,
    num_samples=(500, 0, 0), eod_token=0, vocab_size=1000, cache_path=sys.argv[2])
h = hashlib.sha256()
for i in range(40):
    h.update(train[i]["tokens"].tobytes())
print("DIGEST", h.hexdigest(), type(train.sample_index).__name__)
"""


def test_cache_is_built_once_under_concurrency_and_same_across_processes(tmp_path):
    prefix = write_dataset(tmp_path / "corpus", np.random.default_rng(3).integers(1, 60, 3000))
    cache = str(tmp_path / "cache")
    procs = [subprocess.Popen([sys.executable, "-c", BUILD_IN_SUBPROCESS, prefix, cache], cwd=REPO,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outputs = [p.communicate(timeout=120) for p in procs]
    assert all(p.returncode == 0 for p in procs), outputs
    digests = {line.split()[1] for out, _ in outputs for line in out.splitlines() if line.startswith("DIGEST")}
    assert len(digests) == 1
    assert sum(err.count("built GPTDataset indices") for _, err in outputs) == 1  # one builder, two waiters
    assert all("memmap" in out for out, _ in outputs)
    train, _, _ = build_gpt_datasets(data_path=[prefix], split="1", seq_length=16, seed=9, num_samples=(500, 0, 0),
                                     eod_token=0, vocab_size=1000)  # in memory: default cache dir differs
    assert sample_digest(train) == digests.pop()
    files = sorted(os.listdir(cache))
    assert len([f for f in files if f.endswith(".npy")]) == 3 and not any(".tmp-" in f for f in files)
    description = json.load(open(os.path.join(cache, next(f for f in files if f.endswith("description.json")))))
    assert description["seq_length"] == 16 and description["seed"] == 9 and description["num_samples"] == 500


def test_cache_key_covers_the_inputs(tmp_path):
    prefix = write_dataset(tmp_path / "corpus", np.full(200, 30))
    cache = tmp_path / "cache"

    def build(**kw):
        args = dict(data_path=[prefix], split="1", seq_length=16, seed=1, num_samples=(100, 0, 0), eod_token=0,
                    vocab_size=1000, cache_path=str(cache))
        args.update(kw)
        build_gpt_datasets(**args)
        return len([f for f in os.listdir(cache) if f.endswith("description.json")])

    assert build() == 1 and build() == 1
    assert build(seed=2) == 2 and build(seq_length=8) == 3 and build(num_samples=(101, 0, 0)) == 4
    assert build(split="9,1") == 5
    write_dataset(tmp_path / "corpus", np.full(200, 31))  # same prefix, different lengths
    assert build() == 6

    def document_ids(documents):  # documents as an array of ids rather than a range
        ds = GPTDataset(IndexedDataset(prefix), np.array(documents), None, 16, 1, eod=0, cache_dir=str(cache))
        return sorted(set(ds.document_index.tolist()))

    assert document_ids([0, 5, 7, 199]) == [0, 5, 7, 199]
    assert document_ids([0, 6, 8, 199]) == [0, 6, 8, 199]  # same first, last, count and lengths


def test_masks_match_megatron():
    from megatron.core.datasets import gpt_dataset as gpt_mod
    rng = np.random.default_rng(4)
    for case in range(30):
        tokens = rng.integers(0, 4, int(rng.integers(1, 40)))  # eod (0) frequent, also first and last
        for flags in [(False, False, False), (True, True, True), (True, False, True), (False, True, False)]:
            eod_mask_loss, reset_pos, reset_attn = flags
            loss, pos, attn = ltor_masks(tokens, 0, eod_mask_loss, reset_pos, reset_attn)
            t_attn, t_loss, t_pos = gpt_mod._get_ltor_masks_and_position_ids(
                torch.from_numpy(tokens), 0, reset_pos, reset_attn, eod_mask_loss, True)
            assert np.array_equal(loss, t_loss.numpy()) and np.array_equal(pos, t_pos.numpy()), (case, flags)
            if reset_attn:
                assert attn.dtype == np.bool_ and np.array_equal(attn, t_attn.numpy()), (case, flags)
            else:
                assert attn is None


def test_split_matches_megatron_and_mock_data():
    from megatron.core.datasets import blended_megatron_dataset_config as cfg
    for split in ("969, 30, 1", "949,50,1", "1", "99,1", "0,50,50", "3,3,3"):
        vector = cfg.parse_and_normalize_split(split)
        assert np.allclose(parse_split(split), vector)
        matrix = cfg.convert_split_vector_to_split_matrix(vector)
        for n in (1, 7, 100, 12345):
            expected = [None if m is None or round(m[1] * n) <= round(m[0] * n)
                        else (int(round(m[0] * n)), int(round(m[1] * n))) for m in matrix]
            assert split_ranges(parse_split(split), n) == expected, (split, n)
    with pytest.raises(ValueError, match="--split"):
        parse_split("a,b")
    train, valid, test = build_gpt_datasets(mock_data=True, split="98,2,0", seq_length=64, seed=1,
                                            num_samples=(100, 10, 10), eod_token=999, vocab_size=1000)
    assert test is None and len(train) >= 100 and len(valid) >= 10
    item = train[0]
    assert item["tokens"].shape == (64,) and item["tokens"].dtype == np.int64 and item["loss_mask"].dtype == np.float32
    with pytest.raises(ValueError, match="exactly one of"):
        build_gpt_datasets(seq_length=8, seed=1, num_samples=(1, 1, 1), eod_token=0, vocab_size=10)
