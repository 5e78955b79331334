"""The index arrays behind GPT samples, built with vectorised numpy (no compile step).

For a split's documents and a requested number of samples:
- document index: the documents repeated for enough epochs, shuffled with a seeded
  RandomState (the final epoch shuffled on its own when it is used for less than 80%),
- sample index: row s is (position in the document index, token offset) where sample s
  starts; sample s covers seq_length + 1 tokens up to and including row s + 1's token,
- shuffle index: a seeded permutation of the samples.
These are the arrays, dtypes and random streams of Megatron-Core's GPTDataset, so the same
data and seed give the same samples; the sample index comes from one cumulative sum and one
binary search instead of a per-document loop.
"""

import re
import sys

import numpy as np

SPLIT_NAMES = ("train", "valid", "test")
LAST_EPOCH_SEPARATE_BELOW = 0.80


def parse_split(split: str) -> list[float]:
    """'969, 30, 1' -> normalised fractions for train, valid, test (missing ones are 0)."""
    parts = [float(x) for x in re.findall(r"[.0-9]+", split)]
    if not parts or len(parts) > 3 or sum(parts) <= 0:
        raise ValueError(f"--split {split!r}: expected up to three non-negative weights, e.g. '969, 30, 1'")
    parts += [0.0] * (3 - len(parts))
    total = sum(parts)
    return [p / total for p in parts]


def split_ranges(fractions: list[float], num_docs: int) -> list[tuple[int, int] | None]:
    """Document range [begin, end) of each split (None for an empty split), as Megatron cuts them."""
    bounds = np.concatenate(([0.0], np.cumsum(fractions)))
    out = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        begin, end = int(round(lo * num_docs)), int(round(hi * num_docs))
        out.append((begin, end) if hi > lo and end > begin else None)
    return out


def num_epochs_needed(tokens_per_epoch: int, num_samples: int | None, seq_length: int) -> int:
    """Smallest e with e * tokens_per_epoch >= num_samples * seq_length + 1."""
    if num_samples is None:
        return 1
    if tokens_per_epoch <= 0:
        raise ValueError("the split holds no tokens")
    needed = num_samples * seq_length + 1
    return max(1, -(-needed // tokens_per_epoch))


def separate_final_epoch(num_epochs: int, tokens_per_epoch: int, num_samples: int, seq_length: int) -> bool:
    if num_epochs == 1:
        return False
    before_final = ((num_epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return num_samples - before_final < int(LAST_EPOCH_SEPARATE_BELOW * per_epoch)


def build_document_index(documents, num_epochs: int, rng: np.random.RandomState,
                         separate_final: bool, sizes: np.ndarray | None = None):
    """Documents (a range or an array of ids) repeated num_epochs times, shuffled (int32).

    With `sizes` (all sequence lengths) also returns the lengths in document-index order:
    id and length are shuffled together as one int64 (id << 32 | length), which permutes
    exactly as shuffling the ids alone would, and saves a random gather afterwards.
    """
    if separate_final and num_epochs > 1:
        head = build_document_index(documents, num_epochs - 1, rng, False, sizes)
        tail = build_document_index(documents, 1, rng, False, sizes)
        if sizes is None:
            return np.concatenate((head, tail))
        return np.concatenate((head[0], tail[0])), np.concatenate((head[1], tail[1]))
    contiguous = isinstance(documents, range)
    if sizes is None:
        ids = np.arange(documents.start, documents.stop, dtype=np.int32) if contiguous else \
            np.asarray(documents).astype(np.int32)
        index = np.tile(ids, num_epochs) if num_epochs > 1 else ids
        rng.shuffle(index)
        return index
    if contiguous:
        packed = np.arange(documents.start, documents.stop, dtype=np.int64)
        lengths = sizes[documents.start:documents.stop]
    else:
        packed = np.asarray(documents).astype(np.int64)
        lengths = sizes[packed]
    packed <<= 32
    packed |= lengths
    if num_epochs > 1:
        packed = np.tile(packed, num_epochs)
    rng.shuffle(packed)
    if sys.byteorder == "little":  # the two int32 halves of each int64: [length, id]
        halves = packed.view(np.int32).reshape(-1, 2)
        return np.ascontiguousarray(halves[:, 1]), halves[:, 0]
    return (packed >> 32).astype(np.int32), (packed & 0xFFFFFFFF).astype(np.int32)


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int,
                       num_epochs: int, tokens_per_epoch: int,
                       ordered_sizes: np.ndarray | None = None) -> np.ndarray:
    """[num_samples + 1, 2] (document-index position, offset) of each sample's first token.

    Sample s starts at token s * seq_length of the concatenated document order; its
    position is found by binary search in the cumulative document lengths. A start never
    points at the end of a document (offset < length), matching Megatron's helper.
    `ordered_sizes` (= sizes[document_index]) may be passed when already at hand.
    """
    num_samples = (num_epochs * tokens_per_epoch - 1) // seq_length
    dtype = np.int32 if max(len(document_index), int(sizes.max(initial=0))) <= np.iinfo(np.int32).max else np.int64
    if ordered_sizes is None:
        # np.take from the most compact copy of the lengths: the gather is random access
        table = sizes.astype(np.uint16) if int(sizes.max(initial=0)) < (1 << 16) else sizes
        ordered_sizes = np.take(table, document_index.astype(np.intp))
    ends = np.cumsum(ordered_sizes, dtype=np.int64)
    out = np.empty((num_samples + 1, 2), dtype=dtype)
    chunk = 1 << 22  # bounded temporaries for very long runs
    for lo in range(0, num_samples + 1, chunk):
        starts = np.arange(lo, min(lo + chunk, num_samples + 1), dtype=np.int64) * seq_length
        position = np.searchsorted(ends, starts, side="right")
        before = np.where(position > 0, ends[np.maximum(position - 1, 0)], 0)
        out[lo:lo + len(starts), 0] = position
        out[lo:lo + len(starts), 1] = starts - before
    out[0] = 0  # Megatron starts at (0, 0) even when the first document is empty
    return out


def build_shuffle_index(num_samples: int, total_size: int, rng: np.random.RandomState) -> np.ndarray:
    """A shuffled range [0, num_samples) followed by a separately shuffled [num_samples, total_size)."""
    dtype = np.uint32 if total_size < np.iinfo(np.uint32).max - 1 else np.int64
    first = np.arange(num_samples, dtype=dtype)
    rng.shuffle(first)
    if num_samples == total_size:
        return first
    last = np.arange(num_samples, total_size, dtype=dtype)
    rng.shuffle(last)
    return np.concatenate((first, last))


def build_gpt_indices(sizes: np.ndarray, documents, num_samples: int | None,
                      seq_length: int, seed: int) -> dict[str, np.ndarray]:
    """The document, sample and shuffle indices of one split (`sizes`: all sequence lengths,
    `documents`: the split's document ids, a range or an array)."""
    split_sizes = sizes[documents.start:documents.stop] if isinstance(documents, range) else sizes[documents]
    tokens_per_epoch = int(split_sizes.sum(dtype=np.int64))
    if tokens_per_epoch < 2:
        raise ValueError(f"the split's {len(documents)} documents hold {tokens_per_epoch} tokens; "
                         "a sample needs at least 2")
    epochs = num_epochs_needed(tokens_per_epoch, num_samples, seq_length)
    separate = num_samples is not None and separate_final_epoch(epochs, tokens_per_epoch, num_samples, seq_length)
    rng = np.random.RandomState(seed)
    document_index, ordered_sizes = build_document_index(documents, epochs, rng, separate, sizes)
    sample_index = build_sample_index(sizes, document_index, seq_length, epochs, tokens_per_epoch, ordered_sizes)
    del ordered_sizes
    total = len(sample_index) - 1
    if separate:
        before_final = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
        shuffle_index = build_shuffle_index(before_final, total, rng)
    else:
        shuffle_index = build_shuffle_index(total, total, rng)
    return {"document_index": document_index, "sample_index": sample_index, "shuffle_index": shuffle_index}
