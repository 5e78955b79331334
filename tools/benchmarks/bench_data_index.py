"""Index-building half of bench_data.py: a synthetic Megatron dataset and timed builds.

    python tools/benchmarks/bench_data_index.py --child ours --prefix P --seq-length 2048 --num-samples N

Each build runs in its own process (the parent starts them) so that peak memory
(ru_maxrss) belongs to the build alone. Prints one JSON line.
"""

import argparse
import json
import os
import resource
import struct
import sys
import time

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

from megalite.data.indexed_dataset import CODE_BY_DTYPE, MAGIC, VERSION, write_pointers  # noqa: E402


def write_synthetic_dataset(prefix: str, num_docs: int, num_tokens: int, seed: int = 0) -> np.ndarray:
    """An .idx with num_docs random lengths summing to num_tokens, and a sparse .bin of the
    right size (index building reads lengths only; the tokens are never touched)."""
    rng = np.random.default_rng(seed)
    mean = num_tokens / num_docs
    lengths = rng.integers(1, int(2 * mean), num_docs).astype(np.int64)
    diff = num_tokens - int(lengths.sum())
    while diff:  # nudge random documents by one token until the total is exact
        step = 1 if diff > 0 else -1
        pick = rng.choice(num_docs, min(abs(diff), num_docs), replace=False)
        pick = pick[lengths[pick] + step >= 1]
        lengths[pick] += step
        diff -= step * len(pick)
    lengths = lengths.astype(np.int32)
    dtype = np.dtype(np.uint16)
    with open(prefix + ".idx", "wb") as f:
        f.write(MAGIC + struct.pack("<QBQQ", VERSION, CODE_BY_DTYPE[dtype], num_docs, num_docs + 1))
        f.write(lengths.tobytes())
        write_pointers(f, lengths, dtype.itemsize)
        f.write(np.arange(num_docs + 1, dtype=np.int64).tobytes())
    with open(prefix + ".bin", "wb") as f:
        f.truncate(num_tokens * dtype.itemsize)
    return lengths


def peak_rss_mb() -> float:
    """Peak resident memory of this process since exec (VmHWM; ru_maxrss would also count
    the parent's memory inherited through fork)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def build_ours(prefix, seq_length, num_samples, cache):
    from megalite.data.builder import build_gpt_datasets

    start_rss = peak_rss_mb()
    t0 = time.perf_counter()
    train, _, _ = build_gpt_datasets(data_path=[prefix], split="1", seq_length=seq_length, seed=1234,
                                     num_samples=(num_samples, 0, 0), eod_token=0, vocab_size=50000,
                                     cache_path=cache)
    seconds = time.perf_counter() - t0
    return dict(seconds=seconds, samples=len(train), peak_rss_mb=peak_rss_mb(), rss_before_mb=start_rss,
                digest=_digest(train.document_index, train.sample_index, train.shuffle_index))


def build_megatron(prefix, seq_length, num_samples, cache):
    """The same arrays by Megatron-Core's GPTDataset steps: numpy shuffles, its compiled
    helpers_cpp.build_sample_idx and numpy.save of the three arrays to the cache directory
    (what GPTDataset._build_document_sample_shuffle_indices does)."""
    from megatron.core.datasets import helpers
    from megatron.core.datasets.gpt_dataset import _build_document_index, _build_shuffle_index
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    start_rss = peak_rss_mb()
    t0 = time.perf_counter()
    ds = IndexedDataset(prefix)
    sizes = ds.sequence_lengths
    docs = np.arange(len(sizes), dtype=np.int32)
    tokens = int(np.sum(sizes[docs]))
    epochs = max(1, -(-(num_samples * seq_length + 1) // tokens))
    assert epochs == 1, "the benchmark builds one epoch"
    state = np.random.RandomState(1234)
    document_index = _build_document_index(docs, epochs, state, False)
    t1 = time.perf_counter()
    sample_index = helpers.build_sample_idx(sizes.copy(), document_index, seq_length, epochs, tokens, True, True)
    t2 = time.perf_counter()
    shuffle_index = _build_shuffle_index(len(sample_index) - 1, len(sample_index) - 1, state)
    os.makedirs(cache, exist_ok=True)
    for name, array in (("document_index", document_index), ("sample_index", sample_index),
                        ("shuffle_index", shuffle_index)):
        np.save(os.path.join(cache, f"megatron-{name}.npy"), array, allow_pickle=True)
    seconds = time.perf_counter() - t0
    return dict(seconds=seconds, sample_index_seconds=t2 - t1, samples=len(shuffle_index), peak_rss_mb=peak_rss_mb(),
                rss_before_mb=start_rss, digest=_digest(document_index, sample_index, shuffle_index))


def sample_index_step(prefix, seq_length, repeats=3):
    """The sample-index step alone on identical (sizes, document_index) inputs: Megatron-Core's
    compiled helper against megalite's numpy cumsum + searchsorted, as build_gpt_indices runs
    it (with the document lengths in document-index order that the shuffle produced)."""
    from megatron.core.datasets import helpers

    from megalite.data.gpt_index import build_document_index, build_sample_index
    from megalite.data.indexed_dataset import IndexedDataset

    sizes = np.array(IndexedDataset(prefix).sequence_lengths)
    document_index, ordered_sizes = build_document_index(range(len(sizes)), 1, np.random.RandomState(1234),
                                                         False, sizes)
    tokens = int(sizes.sum(dtype=np.int64))
    best = {"megatron_helper": float("inf"), "megalite": float("inf")}
    for _ in range(repeats):
        t0 = time.perf_counter()
        theirs = helpers.build_sample_idx(sizes, document_index, seq_length, 1, tokens, True, True)
        t1 = time.perf_counter()
        ours = build_sample_index(sizes, document_index, seq_length, 1, tokens, ordered_sizes)
        t2 = time.perf_counter()
        best["megatron_helper"] = min(best["megatron_helper"], t1 - t0)
        best["megalite"] = min(best["megalite"], t2 - t1)
        assert np.array_equal(theirs, ours)
    return best


def _digest(*arrays):
    import hashlib

    h = hashlib.sha256()
    for a in arrays:
        h.update(np.ascontiguousarray(a).tobytes())
    return h.hexdigest()[:16]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--child", choices=["ours", "megatron", "step"], required=True)
    p.add_argument("--prefix", required=True)
    p.add_argument("--seq-length", type=int, default=2048)
    p.add_argument("--num-samples", type=int, required=True)
    p.add_argument("--cache", default=None)
    a = p.parse_args()
    if a.child == "ours":
        out = build_ours(a.prefix, a.seq_length, a.num_samples, a.cache)
    elif a.child == "megatron":
        out = build_megatron(a.prefix, a.seq_length, a.num_samples, a.cache)
    else:
        out = sample_index_step(a.prefix, a.seq_length)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
