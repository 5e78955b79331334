"""Megatron's data flags: --data-args-path and --per-split-data-args-path read as Megatron reads
them, --no-mmap-bin-files, and the flags megalite serves another way (one start-up line each)."""

import json

import numpy as np
import pytest

from megalite.data import build_gpt_datasets
from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megalite.config.run_config import startup_notes
from tests.training.launch import drop_flags
from tests.config.test_arguments import BASE, parsed, refused

NO_DATA = drop_flags(BASE, "--mock-data")


def _dataset(prefix, documents):
    writer = IndexedDatasetWriter(str(prefix), dtype=np.int32)
    for doc in documents:
        writer.add_document(doc)
    writer.finalize()
    return str(prefix)


def _parsed(extra: str, world_size: int = 1):
    from megalite.config.arguments import parse_args, validate_args

    return validate_args(parse_args(NO_DATA + extra.split()), world_size)


def test_data_args_path_is_the_data_path(tmp_path):
    (tmp_path / "blend.txt").write_text("0.3 /data/a\n0.7\t/data/b\n")
    args = _parsed(f"--data-args-path {tmp_path / 'blend.txt'}")
    assert args.data_path == ["0.3", "/data/a", "0.7", "/data/b"] and args.split == "969, 30, 1"
    message = refused(f"--data-args-path {tmp_path / 'blend.txt'} --data-path /data/c")
    assert "--data-path and --data-args-path contradict" in message
    with pytest.raises(ValueError, match=f"--data-args-path {tmp_path / 'missing.txt'}: cannot read it"):
        _parsed(f"--data-args-path {tmp_path / 'missing.txt'}")


def test_per_split_data_args_path_fills_the_split_paths(tmp_path):
    path = tmp_path / "splits.json"
    path.write_text(json.dumps({"train": "1 /d/train1 2 /d/train2", "valid": ["/d/valid"], "test": []}))
    args = _parsed(f"--per-split-data-args-path {path}")
    assert args.train_data_path == ["1", "/d/train1", "2", "/d/train2"]
    assert (args.valid_data_path, args.test_data_path) == (["/d/valid"], None)
    path.write_text('{"train": "/d/t",\n "valid": }')
    with pytest.raises(ValueError, match=f"{path}:2: not valid JSON"):
        _parsed(f"--per-split-data-args-path {path}")
    path.write_text('{"train": "/d/t"}')
    with pytest.raises(ValueError, match="keys train, valid and test"):
        _parsed(f"--per-split-data-args-path {path}")


def test_no_mmap_bin_files_reads_the_bin_into_memory(tmp_path):
    documents = [[5, 6, 7, 1], [8, 9, 1], [10, 11, 12, 13, 1]] * 20
    prefix = _dataset(tmp_path / "corpus", documents)
    mapped, loaded = IndexedDataset(prefix), IndexedDataset(prefix, mmap_bin=False)
    assert isinstance(mapped._bin, np.memmap) and not isinstance(loaded._bin, np.memmap)
    assert all(np.array_equal(mapped[i], loaded[i]) for i in range(len(documents)))
    kinds = []
    for mmap in (True, False):
        train, _, _ = build_gpt_datasets(data_path=[prefix], split="1,0,0", seq_length=8, seed=1,
                                         num_samples=(10, 0, 0), cache_path=str(tmp_path / "cache"), eod_token=1,
                                         vocab_size=64, mmap_bin_files=mmap)
        kinds.append((isinstance(train.indexed._bin, np.memmap), [train[i]["tokens"].tolist() for i in range(10)]))
    assert [k[0] for k in kinds] == [True, False] and kinds[0][1] == kinds[1][1]
    assert parsed("--no-mmap-bin-files", 1).no_mmap_bin_files


@pytest.mark.parametrize("extra, flag", [
    ("--no-create-attention-mask-in-dataloader", "--no-create-attention-mask-in-dataloader"),
    ("--num-dataset-builder-threads 4", "--num-dataset-builder-threads 4"),
    ("--mid-level-dataset-surplus 0.01", "--mid-level-dataset-surplus"),
])
def test_served_another_way_prints_one_line(extra, flag):
    notes = [n for n in startup_notes(parsed(extra, 1)) if n.startswith(flag)]
    assert len(notes) == 1
    assert not [n for n in startup_notes(parsed("", 1)) if n.startswith(flag.split()[0])]


@pytest.mark.parametrize("extra, words", [
    ("--no-create-attention-mask-in-dataloader --reset-attention-mask",
     ["--no-create-attention-mask-in-dataloader", "--reset-attention-mask"]),
    ("--num-dataset-builder-threads 0", ["--num-dataset-builder-threads", "positive"]),
    ("--mid-level-dataset-surplus -0.1", ["--mid-level-dataset-surplus", "negative"]),
])
def test_refusals_name_the_flag(extra, words):
    message = refused(extra)
    assert all(w in message for w in words), message
