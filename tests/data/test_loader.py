"""The data-parallel sampler, resuming, and loading only where needed (PP ends, TP rank 0)."""

import os
import tempfile
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from megalite.data import PretrainingSampler, build_data_iterator, build_gpt_datasets
from megalite.parallel.context import split_sequence
from megalite.parallel.context.split import split_attention_mask
from megalite.parallel.state import ParallelLayout, ParallelState
from tests.data.test_gpt_dataset import write_dataset
from tests.distributed import run_distributed


def megatron_sampler_order(total, consumed, mbs, dp_rank, dp_size):
    """Megatron's MegatronPretrainingSampler, restated: fill a batch of mbs * dp indices
    from consumed on, hand out this rank's slice, drop the last partial batch."""
    out, batch = [], []
    for idx in range(consumed, total):
        batch.append(idx)
        if len(batch) == mbs * dp_size:
            out.append(batch[dp_rank * mbs:(dp_rank + 1) * mbs])
            batch = []
    return out


def test_sampler_matches_megatron_semantics_and_resumes():
    for total, mbs, dp in ((103, 2, 3), (64, 4, 2), (10, 1, 1), (50, 5, 4)):
        for consumed in (0, mbs * dp, 3 * mbs * dp):
            for rank in range(dp):
                got = list(PretrainingSampler(total, consumed, mbs, rank, dp))
                assert got == megatron_sampler_order(total, consumed, mbs, rank, dp)
            ranks = [list(PretrainingSampler(total, 0, mbs, r, dp)) for r in range(dp)]
            step = [i for batches in zip(*ranks) for b in batches for i in b]
            assert step == list(range(len(step)))  # the DP ranks tile the stream, in order
    with pytest.raises(ValueError, match="data-parallel rank"):
        PretrainingSampler(10, 0, 1, 2, 2)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    return write_dataset(tmp_path_factory.mktemp("loader") / "corpus", np.random.default_rng(0).integers(2, 50, 2000))


@pytest.fixture(scope="module")
def mock_train(corpus):
    train, _, _ = build_gpt_datasets(data_path=[corpus], split="1", seq_length=32, seed=11, num_samples=(500, 0, 0),
                                     eod_token=0, vocab_size=1000)
    return train


def test_iterator_yields_dataset_items_and_resumes_exactly(mock_train):
    single = ParallelState.single()
    it = build_data_iterator(mock_train, consumed_samples=0, micro_batch_size=4, global_batch_size=16,
                             pstate=single, num_workers=0)
    full = [next(it) for _ in range(12)]
    for k, batch in enumerate(full[:3]):
        assert batch["tokens"].shape == (4, 32) and batch["tokens"].dtype == torch.int64
        assert batch["loss_mask"].dtype == torch.float32
        expected = np.stack([mock_train[4 * k + i]["tokens"] for i in range(4)])
        assert np.array_equal(batch["tokens"].numpy(), expected)
    # resume after 2 global batches (8 micro-batches), with DataLoader worker processes
    resumed = build_data_iterator(mock_train, consumed_samples=32, micro_batch_size=4, global_batch_size=16,
                                  pstate=single, num_workers=2)
    for a in full[8:]:
        b = next(resumed)
        assert all(torch.equal(a[key], b[key]) for key in a)
    with pytest.raises(ValueError, match="--global-batch-size 10"):
        build_data_iterator(mock_train, consumed_samples=0, micro_batch_size=4, global_batch_size=10,
                            pstate=single, num_workers=0)
    middle_stage = SimpleNamespace(is_first_stage=False, is_last_stage=False)
    assert build_data_iterator(mock_train, consumed_samples=0, micro_batch_size=4, global_batch_size=16,
                               pstate=middle_stage) is None
    assert build_data_iterator(None, consumed_samples=0, micro_batch_size=4, global_batch_size=16,
                               pstate=single) is None


class CountingDataset:
    """A dataset that counts the samples read from it in this process."""

    def __init__(self, dataset):
        self.dataset, self.reads = dataset, 0

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        self.reads += 1
        return self.dataset[i]


def _distributed_loading(rank, world_size, corpus, cache_dir):
    train, _, _ = build_gpt_datasets(data_path=[corpus], split="1", seq_length=16, seed=3, num_samples=(400, 0, 0),
                                     eod_token=0, vocab_size=1000, reset_attention_mask=True, cache_path=cache_dir)
    out = {}
    layouts = (("tp2_dp2", ParallelLayout(4, tensor=2)), ("tp2_pp2", ParallelLayout(4, tensor=2, pipeline=2)))
    for name, layout in layouts:
        state = ParallelState.create(layout)
        counted = CountingDataset(train)
        it = build_data_iterator(counted, consumed_samples=8 if name == "tp2_dp2" else 0, micro_batch_size=2,
                                 global_batch_size=8, pstate=state, num_workers=0)
        batches = [next(it) for _ in range(3)]
        out[name] = {
            "coords": (state.tp_rank, state.dp_rank, state.pp_rank),
            "reads": counted.reads,
            "tokens": [b["tokens"].tolist() for b in batches],
            "attention_mask": [b["attention_mask"].tolist() for b in batches],
            "expected": [[train[i]["tokens"].tolist() for i in idx]
                         for idx in list(PretrainingSampler(len(train), 8 if name == "tp2_dp2" else 0, 2,
                                                            state.dp_rank, state.dp_size))[:3]],
        }
        assert batches[0]["attention_mask"].dtype == torch.bool and batches[0]["attention_mask"].shape == (2, 1, 16, 16)
        assert batches[0]["loss_mask"].dtype == torch.float32
    # CP = 2 with TP = 2: each CP rank gets its chunks of the tokens and its query rows of the
    # whole sequence's document mask (--reset-attention-mask), broadcast to its TP partner.
    state = ParallelState.create(ParallelLayout(4, tensor=2, context=2))
    it = build_data_iterator(train, consumed_samples=0, micro_batch_size=2, global_batch_size=4, pstate=state,
                             num_workers=0)
    got = next(it)
    samples = [train[i] for i in range(2)]
    full_tokens = torch.stack([torch.as_tensor(x["tokens"]) for x in samples])
    full_mask = torch.stack([torch.as_tensor(x["attention_mask"]) for x in samples])
    assert torch.equal(got["tokens"], split_sequence(full_tokens, 1, 2, state.cp_rank))
    assert got["attention_mask"].shape == (2, 1, 8, 16)
    assert torch.equal(got["attention_mask"], split_attention_mask(full_mask, 2, state.cp_rank))
    return out


def test_tp_rank_zero_reads_and_broadcasts_and_dp_ranks_get_their_slices(corpus):
    with tempfile.TemporaryDirectory() as cache_dir:
        results = run_distributed(_distributed_loading, 4, corpus, cache_dir, timeout=240)
        assert len([f for f in os.listdir(cache_dir) if f.endswith("description.json")]) == 1
    for name in ("tp2_dp2", "tp2_pp2"):
        per_rank = [r[name] for r in results]
        for r in per_rank:
            assert r["tokens"] == r["expected"]  # each DP rank's own slice, after consumed samples
            assert r["reads"] == (3 * 2 if r["coords"][0] == 0 else 0), (name, r["coords"], r["reads"])
        for a in per_rank:
            for b in per_rank:
                if a["coords"][1:] == b["coords"][1:]:  # same TP group: identical tensors
                    assert a["tokens"] == b["tokens"] and a["attention_mask"] == b["attention_mask"]
        dp_groups = {r["coords"][1] for r in per_rank}
        if name == "tp2_dp2":
            assert dp_groups == {0, 1} and per_rank[0]["tokens"] != per_rank[2]["tokens"]
