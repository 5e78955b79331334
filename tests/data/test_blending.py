"""Blending: exact proportions at every prefix, the closed form equals the sorted-key order,
--data-path parsing, per-split paths; and the index cache's lock."""

import threading
import time
from fractions import Fraction

import numpy as np
import pytest

from megalite.data import build_gpt_datasets
from megalite.data.blending import blend_indices, integer_weights, parse_data_path
from megalite.data.index_cache import cached_arrays
from tests.data.test_gpt_dataset import write_dataset


def counts_at_every_prefix(dataset_index, num_datasets):
    onehot = np.zeros((len(dataset_index), num_datasets))
    onehot[np.arange(len(dataset_index)), dataset_index] = 1
    return np.cumsum(onehot, axis=0)


def test_three_dataset_blend_matches_weights_within_one_sample_at_every_prefix(tmp_path):
    prefixes = [write_dataset(tmp_path / f"d{k}", np.random.default_rng(k).integers(5, 60, 300), seed=k)
                for k in range(3)]
    weights = [0.2, 0.5, 0.3]
    data_path = [x for w, p in zip(weights, prefixes) for x in (str(w), p)]
    train, valid, test = build_gpt_datasets(data_path=data_path, split="90,10,0", seq_length=16, seed=3,
                                            num_samples=(4000, 300, 0), eod_token=0, vocab_size=1000,
                                            cache_path=str(tmp_path / "cache"))
    assert test is None and len(train) == 4000 and len(valid) == 300
    for blend in (train, valid):
        n = len(blend)
        counts = counts_at_every_prefix(np.asarray(blend.dataset_index), 3)
        expected = np.arange(1, n + 1)[:, None] * np.array(weights)[None]
        assert np.abs(counts - expected).max() < 1.0
        # sample i of the blend is the next unused sample of its dataset
        for j in range(3):
            picked = np.asarray(blend.dataset_sample_index)[np.asarray(blend.dataset_index) == j]
            assert np.array_equal(picked, np.arange(len(picked)))
        for i in range(0, n, 97):
            j, k = int(blend.dataset_index[i]), int(blend.dataset_sample_index[i])
            assert np.array_equal(blend[i]["tokens"], blend.datasets[j][k]["tokens"])


def test_closed_form_equals_sorting_the_keys_exactly():
    rng = np.random.default_rng(0)
    cases = [[1, 1, 1], [0.3, 0.7], [1, 2, 3, 4], [5, 5, 1], [0.001, 0.999]]
    cases += [list(rng.random(int(rng.integers(1, 6))) + 0.01) for _ in range(20)]
    for weights in cases:
        W = [int(x) for x in integer_weights(weights)]
        n = 600
        keys = sorted((Fraction(2 * k + 1, W[j]), j, k) for j in range(len(W)) for k in range(n + 2))[:n]
        dataset_index, sample_index = blend_indices(weights, n)
        assert dataset_index.tolist() == [j for _, j, _ in keys], weights
        assert sample_index.tolist() == [k for _, _, k in keys], weights


def test_blend_error_bound_for_three_random_weights():
    rng = np.random.default_rng(1)
    for _ in range(40):
        w = rng.random(3) ** 3 + 1e-3
        n = int(rng.integers(1, 3000))
        dataset_index, _ = blend_indices(w, n)
        counts = counts_at_every_prefix(dataset_index, 3)
        assert np.abs(counts - np.arange(1, n + 1)[:, None] * (w / w.sum())[None]).max() < 1.0


def test_parse_data_path():
    assert parse_data_path(["prefA"]) == (None, ["prefA"])
    assert parse_data_path(["0.3", "a", "0.7", "b"]) == ([0.3, 0.7], ["a", "b"])
    assert parse_data_path(["0.3 a 0.7 b"]) == ([0.3, 0.7], ["a", "b"])
    assert parse_data_path(["a", "b"]) == (None, ["a", "b"])
    for bad, message in ((["0.3", "a", "b"], "pairs"), (["0.3", "a", "-1", "b"], "positive"), ([], "empty")):
        with pytest.raises(ValueError, match=message) as err:
            parse_data_path(bad, "--train-data-path")
        assert "--train-data-path" in str(err.value)


def test_per_split_data_paths_and_missing_files(tmp_path):
    a = write_dataset(tmp_path / "a", np.full(100, 20))
    b = write_dataset(tmp_path / "b", np.full(50, 20), seed=1)
    train, valid, test = build_gpt_datasets(train_data_path=["1", a, "3", b], valid_data_path=[b], seq_length=10,
                                            seed=1, num_samples=(400, 20, 5), eod_token=0, vocab_size=1000,
                                            cache_path=str(tmp_path / "cache"))
    assert test is None and len(train) == 400 and len(valid) >= 20
    assert np.bincount(np.asarray(train.dataset_index)).tolist() == [100, 300]
    with pytest.raises(ValueError, match="--valid-data-path .*missing"):
        build_gpt_datasets(train_data_path=[a], valid_data_path=[str(tmp_path / "missing")], seq_length=10, seed=1,
                           num_samples=(10, 10, 0), eod_token=0, vocab_size=1000)


def test_index_cache_lock_makes_waiters_load_the_builders_arrays(tmp_path):
    started, release = threading.Event(), threading.Event()
    calls, results = [], {}

    def slow_build():
        calls.append("slow")
        started.set()
        release.wait(10)
        return {"a": np.arange(5)}

    def other_build():
        calls.append("other")
        return {"a": np.zeros(5, np.int64)}

    def run(name, build):
        results[name] = cached_arrays(str(tmp_path), "T", {"k": 1}, ("a",), build, log=lambda m: None)[0]["a"]

    first = threading.Thread(target=run, args=("first", slow_build))
    first.start()
    assert started.wait(10)
    second = threading.Thread(target=run, args=("second", other_build))
    second.start()
    time.sleep(0.5)
    assert second.is_alive() and "second" not in results  # waiting on the lock
    release.set()
    first.join(10)
    second.join(10)
    assert calls == ["slow"]
    assert results["first"].tolist() == results["second"].tolist() == [0, 1, 2, 3, 4]
