"""GPT samples over an indexed dataset: seq_length + 1 tokens spanning documents.

Item i is a dict of numpy arrays: tokens and labels (int64 [s], labels = tokens shifted by
one), loss_mask (float32 [s]), position_ids (int64 [s]) and, with reset_attention_mask,
attention_mask (bool [1, s, s], True = masked out, Megatron's convention).
"""

import os

import numpy as np

from megalite.data.gpt_index import build_gpt_indices
from megalite.data.index_cache import cached_arrays, digest

INDEX_NAMES = ("document_index", "sample_index", "shuffle_index")
INDEX_FORMAT = 1  # bump when the index arrays' meaning changes, to invalidate caches


class MockIndexedDataset:
    """Stand-in for an indexed dataset with no files (--mock-data), as Megatron's mock:
    document lengths drawn from a fixed seed, tokens 1, 2, ... (mod vocab) then eod."""

    def __init__(self, vocab_size: int, eod: int, num_documents: int = 100_000, max_length: int = 4096):
        self.vocab_size, self.eod = vocab_size, eod
        rng = np.random.default_rng(0)
        self.sequence_lengths = rng.integers(1, max_length, size=num_documents, dtype=np.int32)
        self.prefix = f"mock-{num_documents}-{max_length}-{vocab_size}-{eod}"
        self.is_mock = True

    def __len__(self):
        return len(self.sequence_lengths)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        size = int(self.sequence_lengths[i])
        doc = np.concatenate([(np.arange(size - 1, dtype=np.int64) + 1) % self.vocab_size, [self.eod]])
        return doc[offset:] if length is None else doc[offset:offset + length]


def ltor_masks(tokens: np.ndarray, eod: int, eod_mask_loss: bool, reset_position_ids: bool,
               reset_attention_mask: bool):
    """(loss_mask, position_ids, attention_mask or None) for a left-to-right model.

    With resets, a new document starts after each eod token: positions restart at 0 and
    (reset_attention_mask) no token attends across the boundary.
    """
    s = len(tokens)
    is_eod = tokens == eod
    loss_mask = np.ones(s, np.float32)
    if eod_mask_loss:
        loss_mask[is_eod] = 0.0
    positions = np.arange(s, dtype=np.int64)
    # segment id: number of eod tokens strictly before each position
    segment = np.concatenate(([0], np.cumsum(is_eod[:-1]))) if (reset_position_ids or reset_attention_mask) else None
    if reset_position_ids:
        starts = np.zeros(s, np.int64)
        after_eod = np.flatnonzero(is_eod[:-1]) + 1
        starts[after_eod] = after_eod
        positions = positions - np.maximum.accumulate(starts)
    attention_mask = None
    if reset_attention_mask:
        causal = np.tril(np.ones((s, s), dtype=bool))
        attention_mask = ~(causal & (segment[:, None] == segment[None, :]))[None]
    return loss_mask, positions, attention_mask


class GPTDataset:
    """Samples of `seq_length + 1` tokens from the documents `documents` (a range, as splits
    are, or an array of ids) of `indexed`.

    num_samples None means one epoch. Index arrays are cached in cache_dir (None: built in
    memory) under a key covering the documents (a range's bounds, or a digest of the ids),
    their sequence lengths, the sample count, seq_length, seed and split name.
    """

    def __init__(self, indexed, documents, num_samples: int | None, seq_length: int, seed: int,
                 *, eod: int, split_name: str = "train", cache_dir: str | None = None,
                 eod_mask_loss: bool = False, reset_position_ids: bool = False,
                 reset_attention_mask: bool = False, sample_transform=None):
        if seq_length < 1:
            raise ValueError(f"--seq-length must be positive, got {seq_length}")
        self.indexed = indexed
        self.documents = documents if isinstance(documents, range) else np.asarray(documents, dtype=np.int64)
        self.seq_length, self.seed, self.eod = seq_length, seed, eod
        self.split_name = split_name
        self.eod_mask_loss = eod_mask_loss
        self.reset_position_ids = reset_position_ids
        self.reset_attention_mask = reset_attention_mask
        self.sample_transform = sample_transform  # (tokens, index) -> tokens of the same length, e.g. FIM
        sizes = indexed.sequence_lengths
        self.description = {
            "class": "GPTDataset", "format": INDEX_FORMAT, "split": split_name,
            "dataset": indexed.prefix if getattr(indexed, "is_mock", False) else os.path.abspath(indexed.prefix),
            "documents": [int(self.documents[0]), int(self.documents[-1]), len(self.documents)],
            "lengths": digest(sizes[self.documents.start:self.documents.stop]
                              if isinstance(self.documents, range) else sizes[self.documents]),
            "num_samples": num_samples, "seq_length": seq_length, "seed": seed,
        }
        if not isinstance(self.documents, range):
            self.description["document_ids"] = digest(self.documents)
        try:
            arrays, self._paths = cached_arrays(
                cache_dir, "GPTDataset", self.description, INDEX_NAMES,
                lambda: build_gpt_indices(sizes, self.documents, num_samples, seq_length, seed))
        except ValueError as e:
            raise ValueError(f"dataset {indexed.prefix}, {split_name} split: {e}") from None
        self._set_arrays(arrays)

    def _set_arrays(self, arrays):
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]

    def __getstate__(self):  # cached indices travel as paths, not as copies of the arrays
        state = dict(self.__dict__)
        if self._paths is not None:
            for name in INDEX_NAMES:
                state.pop(name)
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if self._paths is not None:
            self._set_arrays({n: np.load(p, mmap_mode="r") for n, p in self._paths.items()})

    def __len__(self) -> int:
        return len(self.shuffle_index)

    def sample_tokens(self, idx: int) -> np.ndarray:
        """The seq_length + 1 token ids of sample idx (after shuffling), int64."""
        i = int(self.shuffle_index[idx])
        (d0, o0), (d1, o1) = self.sample_index[i].tolist(), self.sample_index[i + 1].tolist()
        doc, get = self.document_index, self.indexed.get
        if d0 == d1:
            parts = [get(int(doc[d0]), o0, o1 - o0 + 1)]
        else:
            parts = [get(int(doc[d0]), o0)]
            parts += [get(int(d)) for d in doc[d0 + 1:d1]]
            parts.append(get(int(doc[d1]), 0, o1 + 1))
        return np.concatenate(parts).astype(np.int64)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        if not -len(self) <= idx < len(self):
            raise IndexError(f"sample {idx} out of range for {len(self)} samples")
        text = self.sample_tokens(idx % len(self))
        if self.sample_transform is not None:
            text = self.sample_transform(text, idx % len(self))
        tokens, labels = text[:-1], text[1:]
        loss_mask, position_ids, attention_mask = ltor_masks(
            tokens, self.eod, self.eod_mask_loss, self.reset_position_ids, self.reset_attention_mask)
        item = {"tokens": tokens, "labels": labels, "loss_mask": loss_mask, "position_ids": position_ids}
        if attention_mask is not None:
            item["attention_mask"] = attention_mask
        return item

