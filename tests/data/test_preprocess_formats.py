"""Parquet and zstd inputs give what the same documents as JSONL give; damaged ones stop with
file, position and reason; partitions merged equal one run; merging and inspecting datasets."""

import gzip
import json
import os
import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from megalite.data.indexed_dataset import IndexedDataset, IndexedDatasetWriter
from megalite.data.preprocess import PreprocessConfig, preprocess
from tests.data.conftest import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("preprocess_data")


@pytest.fixture(scope="module")
def paragraphs(demo_texts):
    """600 short documents: the demo corpus's paragraphs."""
    out = [p for t in demo_texts for p in t.split("\n\n") if p.strip()][:600]
    assert len(out) == 600
    return out


def run(module, capsys, *args):
    code = module.main([str(a) for a in args])
    captured = capsys.readouterr()
    return code, captured.err.strip().splitlines(), captured.out


def sp_args(sp_model):
    return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model, "--append-eod"]


def files_of(prefix):
    return [open(f"{prefix}{ext}", "rb").read() for ext in (".bin", ".idx")]


def write_zst(path, lines, frames=3):
    """JSONL lines compressed as several zstd frames (as concatenated .zst files are), with
    content checksums (as the zstd command line writes them). Returns (byte offset, first
    line whose end is in the frame) per frame."""
    data = b"".join(json.dumps(x).encode() + b"\n" for x in lines)
    cut = [len(data) * i // frames for i in range(frames + 1)]
    starts = []
    with open(path, "wb") as f:
        for a, b in zip(cut, cut[1:]):
            starts.append((f.tell(), data[:a].count(b"\n") + 1))
            f.write(zstandard.ZstdCompressor(write_checksum=True).compress(data[a:b]))
    return starts


def test_parquet_and_zstd_give_the_jsonl_bytes(tool, capsys, tmp_path, paragraphs, sp_model):
    """Several row groups, a null row and a non-text row (bytes that are not UTF-8) in
    Parquet; the same rows as JSONL hold null and 5: all skipped and counted alike."""
    texts = paragraphs[:300]
    rows = [t.encode() for t in texts]
    rows[7], rows[150] = None, b"\xff\xfe not text"
    pq.write_table(pa.table({"text": pa.array(rows, pa.binary())}), tmp_path / "in.parquet", row_group_size=64)
    assert pq.ParquetFile(tmp_path / "in.parquet").metadata.num_row_groups == 5
    lines = [{"text": t} for t in texts]
    lines[7], lines[150] = {"text": None}, {"text": 5}
    with open(tmp_path / "in.jsonl", "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
    write_zst(tmp_path / "in.jsonl.zst", lines)
    outputs = {}
    for name in ("in.jsonl", "in.parquet", "in.jsonl.zst"):
        prefix = tmp_path / name.replace(".", "_")
        code, err, _ = run(tool, capsys, "--input", tmp_path / name, "--output-prefix", prefix, *sp_args(sp_model),
                           "--skip-bad-lines", "--workers", 2)
        assert code == 0, err
        skipped = next(line for line in err if line.startswith("skipped 2 bad lines ("))
        if name == "in.parquet":
            assert skipped.startswith("skipped 2 bad lines (1 column 'text' holds bytes that are not UTF-8 text; "
                                      f"1 column 'text' is null), first: {tmp_path / name}: row 8: "), skipped
        else:
            assert skipped.startswith("skipped 2 bad lines (1 key 'text' holds NoneType, expected a string; 1 key "
                                      f"'text' holds int, expected a string), first: {tmp_path / name}:8: "), skipped
        lengths = IndexedDataset(f"{prefix}_text_document").sequence_lengths
        expected = ", ".join(f"{k} {int(np.percentile(lengths, q, method='nearest'))}" for k, q in
                             (("min", 0), ("p10", 10), ("p50", 50), ("p90", 90), ("p99", 99), ("max", 100)))
        assert f"tokens per document: {expected}" in err, err
        outputs[name] = files_of(f"{prefix}_text_document")
    assert outputs["in.parquet"] == outputs["in.jsonl"]
    assert outputs["in.jsonl.zst"] == outputs["in.jsonl"]
    assert len(IndexedDataset(f"{tmp_path / 'in_parquet'}_text_document")) == 298
    # several shards over the row groups (and over the zstd file's whole), two workers: the same bytes
    for name in ("in.parquet", "in.jsonl.zst"):
        prefix = str(tmp_path / f"sharded_{name.replace('.', '_')}")
        with open(os.devnull, "w") as quiet:
            preprocess(PreprocessConfig(input=[str(tmp_path / name)], output_prefix=prefix, append_eod=True,
                                        tokenizer_type="SentencePieceTokenizer", tokenizer_model=sp_model,
                                        skip_bad_lines=True, workers=2, partitions=4, max_shard_bytes=1),
                       stream=quiet)
        assert files_of(prefix + "_text_document") == outputs["in.jsonl"]


def test_parquet_bad_rows_and_columns_stop_naming_file_and_row(tool, capsys, tmp_path):
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", 100]
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"text": ["1 2", "3", None, "4"]}), path, row_group_size=2)
    code, err, _ = run(tool, capsys, "--input", path, "--output-prefix", tmp_path / "o", *null)
    assert code == 1 and err == [f"error: {path}: row 3: column 'text' is null"], err
    pq.write_table(pa.table({"text": [1, 2]}), path)
    code, err, _ = run(tool, capsys, "--input", path, "--output-prefix", tmp_path / "o", *null)
    assert code == 1 and err == [f"error: {path}: row 1: column 'text' holds int64, expected a string"], err
    code, err, _ = run(tool, capsys, "--input", path, "--output-prefix", tmp_path / "o", *null, "--json-keys", "body")
    assert code == 1 and err == [f"error: {path}: row 1: missing column 'body' (columns present: ['text'])"], err
    (tmp_path / "b.parquet").write_bytes(b'{"text": "not parquet"}\n')
    code, err, _ = run(tool, capsys, "--input", tmp_path / "b.parquet", "--output-prefix", tmp_path / "o", *null)
    assert code == 1 and err[0].startswith(f"error: {tmp_path / 'b.parquet'}: row 1: not a readable Parquet file ("), err
    assert sorted(os.listdir(tmp_path)) == ["a.parquet", "b.parquet"]


@pytest.mark.parametrize("checksums", [True, False])
def test_corrupt_parquet_page_is_fatal_and_named(tool, capsys, tmp_path, checksums):
    """Damaged data in row group 2: with page checksums any damage is caught; without, the
    compression codec catches it. Either way the run stops even with --skip-bad-lines."""
    path = tmp_path / "c.parquet"
    pq.write_table(pa.table({"text": [f"{i} {i + 1}" * 20 for i in range(400)]}), path, row_group_size=100,
                   write_page_checksum=checksums, use_dictionary=False, compression="zstd")
    column = pq.ParquetFile(path).metadata.row_group(2).column(0)
    data = bytearray(path.read_bytes())
    middle = column.data_page_offset + column.total_compressed_size // 2
    data[middle:middle + 8] = b"XXXXXXXX"
    path.write_bytes(bytes(data))
    code, err, _ = run(tool, capsys, "--input", path, "--output-prefix", tmp_path / "o", "--skip-bad-lines",
                       "--tokenizer-type", "NullTokenizer", "--vocab-size", 500)
    assert code == 1 and len(err) == 1, err
    assert err[0].startswith(f"error: {path}: row 201: corrupt Parquet data in row group 2 (rows 201 to 300): "), err
    assert sorted(os.listdir(tmp_path)) == ["c.parquet"]


def test_damaged_zstd_frame_is_fatal_and_named(tool, capsys, tmp_path):
    lines = [{"text": f"{i} {i + 1}"} for i in range(3000)]
    frames = write_zst(tmp_path / "good.jsonl.zst", lines)
    good = (tmp_path / "good.jsonl.zst").read_bytes()
    second = frames[1][0]
    cases = {"truncated": (good[:-5], f"the file is truncated inside the frame starting at byte {frames[2][0]}",
                           frames[2][1]),
             "corrupt": (good[:second + 30] + b"\x00" * 4 + good[second + 34:],
                         f"in the frame starting at byte {second}", frames[1][1])}
    for name, (content, reason, first_line) in cases.items():
        path = tmp_path / f"{name}.jsonl.zst"
        path.write_bytes(content)
        code, err, _ = run(tool, capsys, "--input", path, "--output-prefix", tmp_path / "o", "--skip-bad-lines",
                           "--tokenizer-type", "NullTokenizer", "--vocab-size", 5000)
        assert code == 1 and len(err) == 1 and err[0].startswith(f"error: {path}:"), err
        assert "corrupt zstd data (" in err[0] and reason in err[0], err
        line = int(err[0][len(f"error: {path}:"):].split(":")[0])
        assert line >= first_line, err  # the lines before the damaged frame were read
    assert not [n for n in os.listdir(tmp_path) if n.startswith("o")]


def test_three_partitions_merged_equal_one_run(tool, capsys, tmp_path, paragraphs, sp_model):
    """A mix of JSONL (cut inside), Parquet (cut between row groups), gzip and zstd (whole)."""
    docs = [{"text": t} for t in paragraphs[:600]]
    src = tmp_path / "src"
    src.mkdir()
    with open(src / "a.jsonl", "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in docs[:300])
    pq.write_table(pa.table({"text": [d["text"] for d in docs[300:450]]}), src / "b.parquet", row_group_size=20)
    with gzip.open(src / "c.jsonl.gz", "wt") as f:
        f.writelines(json.dumps(x) + "\n" for x in docs[450:500])
    write_zst(src / "d.jsonl.zst", docs[500:])
    single = tmp_path / "single"
    code, err, _ = run(tool, capsys, "--input", src, "--output-prefix", single, *sp_args(sp_model))
    assert code == 0, err
    parts = []
    for i in range(3):
        code, err, _ = run(tool, capsys, "--input", src, "--output-prefix", tmp_path / "part", *sp_args(sp_model),
                           "--partitions", 3, "--partition-index", i, "--workers", 2)
        assert code == 0, err
        parts.append(tmp_path / f"part-{i:05d}-of-00003_text_document")
        assert len(IndexedDataset(str(parts[-1]))) > 100  # every partition has a real share
    merge = load_tool("merge_datasets")
    code, err, _ = run(merge, capsys, "--input", *[f"{p}{ext}" for p in parts for ext in (".bin", ".idx")],
                       "--output-prefix", tmp_path / "merged")
    assert code == 0 and err[0].startswith("merged 3 datasets: 600 documents"), err
    assert files_of(tmp_path / "merged") == files_of(f"{single}_text_document")
    code, err, _ = run(tool, capsys, "--input", src, "--output-prefix", tmp_path / "x", *sp_args(sp_model),
                       "--partitions", 3, "--partition-index", 3)
    assert code == 1 and "--partition-index 3" in err[0], err


def test_merge_refuses_different_dtypes_naming_them(capsys, tmp_path):
    for name, dtype in (("small", np.uint16), ("large", np.int32)):
        with IndexedDatasetWriter(str(tmp_path / name), dtype) as writer:
            writer.add_document([1, 2, 3])
    merge = load_tool("merge_datasets")
    code, err, _ = run(merge, capsys, "--input", tmp_path / "small", tmp_path / "large", "--output-prefix",
                       tmp_path / "merged")
    assert code == 1 and err == [f"error: cannot merge datasets of different dtypes: {tmp_path / 'small'} holds "
                                 f"uint16, {tmp_path / 'large'} holds int32"], err
    assert not [n for n in os.listdir(tmp_path) if n.startswith("merged")]
    code, err, _ = run(merge, capsys, "--input", tmp_path / "small", tmp_path / "small", "--output-prefix",
                       tmp_path / "twice")  # a prefix named twice is merged once
    assert code == 0 and IndexedDataset(str(tmp_path / "twice")).num_tokens == 3, err


def test_inspect_data_reports_counts_histogram_and_decoded_documents(tool, capsys, tmp_path, paragraphs, sp_model):
    path = tmp_path / "in.jsonl"
    with open(path, "w") as f:
        f.writelines(json.dumps({"text": t}) + "\n" for t in paragraphs[:40])
    code, err, _ = run(tool, capsys, "--input", path, "--output-prefix", tmp_path / "ds", *sp_args(sp_model))
    assert code == 0, err
    prefix = tmp_path / "ds_text_document"
    ds = IndexedDataset(str(prefix))
    inspect = load_tool("inspect_data")
    code, err, out = run(inspect, capsys, f"{prefix}.bin", "--tokenizer-type", "SentencePieceTokenizer",
                         "--tokenizer-model", sp_model, "--show", 2, "--max-chars", 100000)
    assert code == 0, err
    lines = out.splitlines()
    assert f"documents  {len(ds)}" in lines and f"tokens     {ds.num_tokens}" in lines and "dtype      uint16" in lines
    buckets = [tuple(map(int, re.match(r"  \[ *(\d+), *(\d+)\) +(\d+)", line).groups()))
               for line in lines if line.startswith("  [")]
    assert sum(count for _, _, count in buckets) == len(ds)
    for low, high, count in buckets:
        assert count == int(((ds.sequence_lengths >= low) & (ds.sequence_lengths < high)).sum())
    assert f"--- document 1: {len(ds[1])} tokens" in lines
    assert paragraphs[0] in out and paragraphs[1] in out and paragraphs[2] not in out
    code, err, out = run(inspect, capsys, str(prefix), "--show", 1)  # no tokenizer: the ids
    assert code == 0 and " ".join(map(str, ds[0].tolist())) in out.splitlines()
    code, err, _ = run(inspect, capsys, str(tmp_path / "missing"))
    assert code == 1 and "missing" in err[0]
