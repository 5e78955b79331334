"""MMIDIDX compatibility with Megatron-Core in both directions, merging, and bad files."""

import os
import pickle
import struct

import numpy as np
import pytest
import torch
from megatron.core.datasets import indexed_dataset as megatron_indexed  # a dev dependency: fail, never skip

from megalite.data.indexed_dataset import (IndexedDataset, IndexedDatasetWriter, dtype_for_vocab,
                                           merge_datasets)


def random_documents(seed, count=200, vocab=60000, max_len=80):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, int(rng.integers(0, max_len))) for _ in range(count)]


def write_megalite(prefix, docs, dtype):
    with IndexedDatasetWriter(prefix, dtype) as w:
        for d in docs:
            w.add_document(d)


def write_megatron(prefix, docs, dtype):
    b = megatron_indexed.IndexedDatasetBuilder(prefix + ".bin", dtype=dtype)
    for d in docs:
        b.add_document(torch.tensor(d), [len(d)])
    b.finalize(prefix + ".idx")


def same_bytes(a, b):
    return all(open(a + ext, "rb").read() == open(b + ext, "rb").read() for ext in (".bin", ".idx"))


@pytest.mark.parametrize("vocab", [50257, 128256])
def test_files_are_byte_identical_to_megatron_core_and_read_both_ways(tmp_path, vocab):
    dtype = dtype_for_vocab(vocab)
    assert dtype == megatron_indexed.DType.optimal_dtype(vocab)
    docs = random_documents(0, vocab=min(vocab, 65000))
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    write_megalite(ours, docs, dtype)
    write_megatron(theirs, docs, dtype)
    assert same_bytes(ours, theirs)
    megatron_reads_ours = megatron_indexed.IndexedDataset(ours)
    we_read_theirs = IndexedDataset(theirs)
    assert len(megatron_reads_ours) == len(we_read_theirs) == len(docs)
    np.testing.assert_array_equal(we_read_theirs.document_indices, megatron_reads_ours.document_indices)
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(megatron_reads_ours[i], d)
        np.testing.assert_array_equal(we_read_theirs[i], d)
        assert we_read_theirs[i].dtype == dtype
    # partial reads agree with Megatron's get(idx, offset, length)
    for i in range(0, len(docs), 17):
        n = len(docs[i])
        if n > 3:
            np.testing.assert_array_equal(we_read_theirs.get(i, 2, n - 3), megatron_reads_ours.get(i, 2, n - 3))


def test_sentence_level_documents_and_multimodal_modes_match_megatron(tmp_path):
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    sentences = random_documents(1, count=30)
    w = IndexedDatasetWriter(ours, np.uint16, multimodal=True)
    b = megatron_indexed.IndexedDatasetBuilder(theirs + ".bin", dtype=np.uint16, multimodal=True)
    for i, s in enumerate(sentences):
        w.add_item(s, mode=i % 3)
        b.add_item(torch.tensor(s), mode=i % 3)
        if i % 4 == 3:
            w.end_document()
            b.end_document()
    w.finalize()
    b.finalize(theirs + ".idx")
    assert same_bytes(ours, theirs)
    ds = IndexedDataset(ours)
    np.testing.assert_array_equal(ds.sequence_modes, [i % 3 for i in range(30)])
    np.testing.assert_array_equal(ds.document_indices, [0, 4, 8, 12, 16, 20, 24, 28])


def test_merge_matches_megatron_add_index(tmp_path):
    parts = []
    for k in range(3):
        prefix = str(tmp_path / f"part{k}")
        write_megatron(prefix, random_documents(10 + k, count=20 + k), np.uint16)
        parts.append(prefix)
    ours, theirs = str(tmp_path / "merged"), str(tmp_path / "merged_mc")
    merge_datasets(ours, parts)
    b = megatron_indexed.IndexedDatasetBuilder(theirs + ".bin", dtype=np.uint16)
    for p in parts:
        b.add_index(p)
    b.finalize(theirs + ".idx")
    assert same_bytes(ours, theirs)
    assert len(IndexedDataset(ours)) == 20 + 21 + 22


@pytest.mark.parametrize("dtype", [np.uint16, np.int32])
def test_add_documents_from_bytes_or_an_array_writes_what_add_document_writes(tmp_path, dtype):
    docs = [d for d in random_documents(7, count=50, vocab=60000) if len(d)]
    flat, lengths = np.concatenate(docs).astype(dtype), [len(d) for d in docs]
    write_megalite(str(tmp_path / "one_by_one"), docs, dtype)
    for name, data in (("bytes", flat.tobytes()), ("array", flat)):
        with IndexedDatasetWriter(str(tmp_path / name), dtype) as w:
            w.add_documents(data[:0], [])  # an empty batch changes nothing
            w.add_documents(data, lengths)
        assert same_bytes(str(tmp_path / "one_by_one"), str(tmp_path / name)), name


@pytest.mark.parametrize("kernel_copy", ["refused", "absent"])
def test_merge_without_the_kernel_copy_writes_the_same_files(tmp_path, monkeypatch, kernel_copy):
    parts = []
    for k in range(3):  # a part above the 1 MiB buffer, so that the portable copy loops
        prefix = str(tmp_path / f"part{k}")
        write_megalite(prefix, random_documents(20 + k, count=400 if k == 1 else 30, max_len=4000), np.uint16)
        parts.append(prefix)
    merge_datasets(str(tmp_path / "kernel"), parts)
    if kernel_copy == "absent":
        monkeypatch.delattr(os, "copy_file_range")
    else:
        def refuse(*args):
            raise OSError(18, "Invalid cross-device link")
        monkeypatch.setattr(os, "copy_file_range", refuse)
    merge_datasets(str(tmp_path / "portable"), parts)
    assert os.path.getsize(parts[1] + ".bin") > 1 << 20
    assert same_bytes(str(tmp_path / "kernel"), str(tmp_path / "portable"))
    merged = IndexedDataset(str(tmp_path / "portable"))
    expected = [d for p in parts for d in (IndexedDataset(p)[i] for i in range(len(IndexedDataset(p))))]
    assert len(merged) == len(expected) and all(np.array_equal(merged[i], d) for i, d in enumerate(expected))


def test_writer_uses_temporary_names_until_finalize_and_abort_leaves_nothing(tmp_path):
    prefix = str(tmp_path / "ds")
    w = IndexedDatasetWriter(prefix, np.uint16)
    w.add_document([1, 2, 3])
    assert not os.path.exists(prefix + ".bin") and not os.path.exists(prefix + ".idx")
    w.abort()
    assert os.listdir(tmp_path) == []
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(prefix, np.uint16) as w:
            w.add_document([1])
            raise RuntimeError("crash")
    assert os.listdir(tmp_path) == []


def test_reader_is_zero_copy_picklable_and_handles_empty(tmp_path):
    prefix = str(tmp_path / "ds")
    write_megalite(prefix, [np.arange(5), np.arange(3)], np.uint16)
    ds = IndexedDataset(prefix)
    view = ds[0]
    assert not view.flags.owndata and not view.flags.writeable
    again = pickle.loads(pickle.dumps(ds))
    np.testing.assert_array_equal(again[1], [0, 1, 2])
    assert len(pickle.dumps(ds)) < 200  # the prefix travels, not the data
    empty = str(tmp_path / "empty")
    write_megalite(empty, [], np.uint16)
    assert len(IndexedDataset(empty)) == 0 and IndexedDataset(empty).num_tokens == 0


def test_bad_files_are_refused_with_the_file_named(tmp_path):
    prefix = str(tmp_path / "ds")
    write_megalite(prefix, [np.arange(10)], np.uint16)
    idx = open(prefix + ".idx", "rb").read()
    with pytest.raises(ValueError, match="does not exist"):
        IndexedDataset(str(tmp_path / "missing"))
    cases = {
        "not an MMIDIDX index": b"NOTMAGIC!" + idx[9:],
        "version 2": idx[:9] + struct.pack("<Q", 2) + idx[17:],
        "unknown dtype code 9": idx[:17] + b"\x09" + idx[18:],
        "expected": idx[:-3],
    }
    for message, content in cases.items():
        with open(prefix + ".idx", "wb") as f:
            f.write(content)
        with pytest.raises(ValueError, match=message) as err:
            IndexedDataset(prefix)
        assert prefix + ".idx" in str(err.value)
    with open(prefix + ".idx", "wb") as f:
        f.write(idx)
    with open(prefix + ".bin", "r+b") as f:
        f.truncate(8)
    with pytest.raises(ValueError, match=r"ds\.bin: 8 bytes"):
        IndexedDataset(prefix)
