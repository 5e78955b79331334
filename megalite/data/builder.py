"""build_gpt_datasets: train/valid/test datasets from Megatron's data flags."""

import os

import numpy as np

from megalite.data.blending import BlendedDataset, cached_blend_indices, parse_data_path, samples_needed
from megalite.data.gpt_dataset import GPTDataset, MockIndexedDataset
from megalite.data.gpt_index import SPLIT_NAMES, parse_split, split_ranges
from megalite.data.indexed_dataset import IndexedDataset

DEFAULT_CACHE_SUBDIR = os.path.join("cache", "GPTDataset_indices")


def build_gpt_datasets(*, data_path=None, train_data_path=None, valid_data_path=None, test_data_path=None,
                       split: str = "969, 30, 1", seq_length: int, seed: int, num_samples=(None, None, None),
                       cache_path: str | None = None, mock_data: bool = False, eod_token: int,
                       vocab_size: int, eod_mask_loss: bool = False, reset_position_ids: bool = False,
                       reset_attention_mask: bool = False, mmap_bin_files: bool = True, sample_transform=None):
    """(train, valid, test) GPT datasets; a split without data, or asked for 0 samples, is None.

    data_path (and the per-split paths) are lists as argparse nargs='*' gives them:
    ["prefix"] or ["0.3", "prefA", "0.7", "prefB"]. With data_path (or mock_data) the
    documents are cut by `split`; a per-split path is used whole for its split.
    num_samples[j] None means one epoch of split j (unblended data only).
    Index arrays are cached in cache_path (default: <data dir>/cache/GPTDataset_indices;
    mock data is indexed in memory unless cache_path is given). mmap_bin_files False
    (--no-mmap-bin-files) reads each .bin file into memory instead of memory-mapping it.
    sample_transform(tokens, index) rewrites each sample's tokens (--fim-data: megalite.data.fim).
    """
    per_split_paths = (train_data_path, valid_data_path, test_data_path)
    if sum(bool(x) for x in (data_path, any(per_split_paths), mock_data)) != 1:
        raise ValueError("give exactly one of --data-path, --train/valid/test-data-path or --mock-data")
    if len(num_samples) != 3:
        raise ValueError(f"num_samples must give (train, valid, test), got {num_samples!r}")
    options = dict(seq_length=seq_length, seed=seed, eod=eod_token, eod_mask_loss=eod_mask_loss,
                   reset_position_ids=reset_position_ids, reset_attention_mask=reset_attention_mask,
                   sample_transform=sample_transform)
    if mock_data:
        mock = MockIndexedDataset(vocab_size, eod_token)
        ranges = split_ranges(parse_split(split), len(mock))
        return tuple(_single(mock, ranges[j], num_samples[j], SPLIT_NAMES[j], cache_path, options)
                     for j in range(3))
    if data_path:
        weights, prefixes = parse_data_path(data_path, "--data-path")
        fractions = parse_split(split)
        indexed = [_open(p, "--data-path", mmap_bin_files) for p in prefixes]
        ranges = [split_ranges(fractions, len(ds)) for ds in indexed]
        return tuple(_split_dataset(indexed, weights, [r[j] for r in ranges], num_samples[j], SPLIT_NAMES[j],
                                    cache_path, options) for j in range(3))
    out = []
    for j, (paths, flag) in enumerate(zip(per_split_paths, ("--train-data-path", "--valid-data-path",
                                                             "--test-data-path"))):
        if not paths:
            out.append(None)
            continue
        weights, prefixes = parse_data_path(paths, flag)
        indexed = [_open(p, flag, mmap_bin_files) for p in prefixes]
        whole = [(0, len(ds)) if len(ds) else None for ds in indexed]
        out.append(_split_dataset(indexed, weights, whole, num_samples[j], SPLIT_NAMES[j], cache_path, options))
    return tuple(out)


def _open(prefix: str, flag: str, mmap_bin_files: bool = True) -> IndexedDataset:
    try:
        return IndexedDataset(prefix, mmap_bin=mmap_bin_files)
    except ValueError as e:
        raise ValueError(f"{flag} {prefix}: {e}") from None


def _cache_dir(cache_path: str | None, dataset) -> str | None:
    if cache_path is not None:
        return cache_path
    if getattr(dataset, "is_mock", False):
        return None
    return os.path.join(os.path.dirname(os.path.abspath(dataset.prefix)), DEFAULT_CACHE_SUBDIR)


def _single(dataset, doc_range, num_samples, split_name, cache_path, options):
    if doc_range is None or num_samples == 0:
        return None
    return GPTDataset(dataset, range(*doc_range), num_samples, split_name=split_name,
                      cache_dir=_cache_dir(cache_path, dataset), **options)


def _split_dataset(indexed, weights, doc_ranges, num_samples, split_name, cache_path, options):
    """One split over one or more (blended) indexed datasets."""
    if num_samples == 0 or all(r is None for r in doc_ranges):
        return None
    if len(indexed) == 1:
        return _single(indexed[0], doc_ranges[0], num_samples, split_name, cache_path, options)
    for ds, r in zip(indexed, doc_ranges):
        if r is None:
            raise ValueError(f"dataset {ds.prefix} has no documents in the {split_name} split; "
                             "every blended dataset needs some")
    if num_samples is None:
        raise ValueError(f"a blended {split_name} split needs a sample count")
    if weights is None:  # several prefixes without weights: mix in proportion to their tokens
        weights = [int(ds.sequence_lengths[slice(*r)].sum(dtype=np.int64)) for ds, r in zip(indexed, doc_ranges)]
    description = {"split": split_name, "datasets": [os.path.abspath(ds.prefix) for ds in indexed],
                   "ranges": [list(r) for r in doc_ranges]}
    cache_dir = cache_path if cache_path is not None else _cache_dir(None, indexed[0])
    dataset_index, sample_index = cached_blend_indices(weights, num_samples, cache_dir, description)
    needed = samples_needed(dataset_index, sample_index, len(indexed))
    parts = [_single(ds, r, max(n, 1), split_name, cache_path, options)
             for ds, r, n in zip(indexed, doc_ranges, needed)]
    return BlendedDataset(parts, weights, dataset_index, sample_index)


def megatron_num_samples(train_iters: int, eval_interval: int, eval_iters: int, global_batch_size: int):
    """(train, valid, test) sample counts as Megatron computes them from the schedule."""
    return (train_iters * global_batch_size,
            (train_iters // eval_interval + 1) * eval_iters * global_batch_size,
            eval_iters * global_batch_size)


