"""tools/merge_datasets.py takes a glob over dataset prefixes itself (no file is named like a
prefix, so a shell passes such a pattern on, or refuses it), merges the matches in partition
order, and refuses an incomplete set of partitions. megalite/data/README.md's command as written, through
bash:
tests/docs/test_readme_commands.py."""

import os

from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from tests.data.conftest import load_tool

merge = load_tool("merge_datasets")


def _write(prefix, first_token: int):
    with IndexedDatasetWriter(str(prefix), "uint16") as writer:
        writer.add_document([first_token, 7])


def _run(capsys, *argv):
    code = merge.main([str(a) for a in argv])
    return code, capsys.readouterr().err.strip().splitlines()


def test_a_glob_merges_every_partition_in_numeric_order(tmp_path, capsys):
    for i in range(12):  # unpadded names: "10" sorts before "2" as text
        _write(tmp_path / f"part-{i}-of-12_text_document", i)
    _write(tmp_path / "other_text_document", 99)
    code, err = _run(capsys, "--input", tmp_path / "part-*-of-12_text_document", "--output-prefix", tmp_path / "merged")
    assert code == 0 and err[-1].startswith("merged 12 datasets: 12 documents"), err
    merged = IndexedDataset(str(tmp_path / "merged"))
    assert [merged[i][0] for i in range(len(merged))] == list(range(12))


def test_a_glob_with_a_partition_missing_is_refused_naming_it(tmp_path, capsys):
    for i in (0, 1, 3):
        _write(tmp_path / f"corpus-{i:05d}-of-00004_text_document", i)
    pattern = tmp_path / "corpus-*-of-00004_text_document"
    code, err = _run(capsys, "--input", pattern, "--output-prefix", tmp_path / "merged")
    assert code == 1 and err == [f"error: --input {pattern}: 1 of the 4 partitions of {tmp_path / 'corpus'}"
                                 "_text_document are missing (index 2); merged, the dataset would not be the "
                                 "whole corpus"], err
    assert not [n for n in os.listdir(tmp_path) if n.startswith("merged")]


def test_a_glob_that_matches_nothing_is_refused(tmp_path, capsys):
    pattern = tmp_path / "corpus-*-of-00064_text_document"
    code, err = _run(capsys, "--input", pattern, "--output-prefix", tmp_path / "merged")
    assert code == 1 and err == [f"error: --input {pattern}: matches no dataset ({pattern}.bin / .idx)"], err


def test_globs_over_files_and_names_with_glob_characters(tmp_path, capsys):
    for i in range(2):
        _write(tmp_path / f"p-{i}-of-2_text_document", i)
    _write(tmp_path / "odd[1]_text_document", 5)  # an existing prefix is taken as it is
    code, err = _run(capsys, "--input", tmp_path / "p-*-of-2_text_document.bin", tmp_path / "odd[1]_text_document",
                     "--output-prefix", tmp_path / "merged")
    assert code == 0, err
    merged = IndexedDataset(str(tmp_path / "merged"))
    assert [merged[i][0] for i in range(len(merged))] == [0, 1, 5]
