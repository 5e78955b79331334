"""tools/preprocess_data.py: formats, determinism across workers, bad input, empty documents."""

import gzip
import json
import os
import zlib

import numpy as np
import pytest

from megalite.data.indexed_dataset import IndexedDataset
from megalite.data.tokenizers import build_tokenizer
from tests.data.conftest import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("preprocess_data")


def run(tool, capsys, *args):
    """Run the tool in-process; return (exit code, stderr lines)."""
    code = tool.main([str(a) for a in args])
    return code, capsys.readouterr().err.strip().splitlines()


def sp_args(sp_model):
    return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", sp_model]


def expected_documents(tok, texts, append_eod=True):
    out = [tok.encode(t) for t in texts]
    return [ids + [tok.eod] if append_eod else ids for ids in out if ids]


def read_documents(prefix):
    ds = IndexedDataset(prefix)
    return [ds[i].tolist() for i in range(len(ds))]


def test_jsonl_output_is_the_tokenised_text_and_independent_of_workers(tool, capsys, tmp_path, demo_corpus,
                                                                      demo_texts, sp_model):
    from megatron.core.datasets import indexed_dataset as megatron_indexed  # a dev dependency: fail, never skip
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    outputs = []
    for workers, partitions in ((1, 1), (2, 5)):
        prefix = tmp_path / f"w{workers}"
        code, err = run(tool, capsys, "--input", demo_corpus, "--output-prefix", prefix, *sp_args(sp_model),
                        "--append-eod", "--workers", workers, "--partitions", partitions, "--log-interval", 100)
        assert code == 0, err
        assert any("docs/s" in line and "MB/s" in line and "tokens/s" in line for line in err)
        outputs.append(str(prefix) + "_text_document")
    assert read_documents(outputs[0]) == expected_documents(tok, demo_texts)
    for ext in (".bin", ".idx"):
        assert open(outputs[0] + ext, "rb").read() == open(outputs[1] + ext, "rb").read()
    assert IndexedDataset(outputs[0]).dtype == np.uint16
    theirs = megatron_indexed.IndexedDataset(outputs[1])
    assert [theirs[i].tolist() for i in range(len(theirs))] == read_documents(outputs[0])
    assert sorted(os.listdir(tmp_path)) == sorted(os.path.basename(o) + e for o in outputs for e in (".bin", ".idx"))


def test_gzip_text_directories_globs_and_several_keys(tool, capsys, tmp_path, demo_texts, gpt2_files):
    vocab, merges, _ = gpt2_files
    tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    gpt2 = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", vocab, "--merge-file", merges]
    docs = [t for t in demo_texts[:40]]
    src = tmp_path / "src"
    src.mkdir()
    with gzip.open(src / "a.jsonl.gz", "wt", encoding="utf-8") as f:
        for t in docs[:20]:
            f.write(json.dumps({"text": t, "title": t[:10]}) + "\n")
    with open(src / "b.jsonl", "w", encoding="utf-8") as f:
        for t in docs[20:]:
            f.write(json.dumps({"text": t, "title": t[:10]}) + "\n")
    code, err = run(tool, capsys, "--input", src, "--output-prefix", tmp_path / "keys", *gpt2,
                    "--json-keys", "text", "title")
    assert code == 0, err
    assert read_documents(tmp_path / "keys_text_document") == expected_documents(tok, docs, append_eod=False)
    assert read_documents(tmp_path / "keys_title_document") == expected_documents(tok, [t[:10] for t in docs], False)

    lines = [t.replace("\n", " ") for t in docs]
    (src / "c.txt").write_text("\n".join(lines[:30]) + "\n", encoding="utf-8")
    (src / "d.txt").write_text("\n".join(lines[30:]), encoding="utf-8")
    code, err = run(tool, capsys, "--input", str(src / "*.txt"), "--output-prefix", tmp_path / "lines", *gpt2,
                    "--append-eod")
    assert code == 0, err
    assert read_documents(tmp_path / "lines_text_document") == expected_documents(tok, lines)

    per_file = tmp_path / "files"
    per_file.mkdir()
    for i, t in enumerate(docs[:5]):
        (per_file / f"doc{i}.txt").write_text(t, encoding="utf-8")
    code, err = run(tool, capsys, "--input", per_file, "--output-prefix", tmp_path / "files", *gpt2,
                    "--text-mode", "file")
    assert code == 0, err
    assert read_documents(tmp_path / "files_text_document") == expected_documents(tok, docs[:5], False)


def test_null_tokenizer_and_empty_documents_are_skipped_and_counted(tool, capsys, tmp_path):
    src = tmp_path / "in.jsonl"
    src.write_text('{"text": "1 2 3"}\n{"text": ""}\n\n{"text": "   "}\n{"text": "4"}\n', encoding="utf-8")
    code, err = run(tool, capsys, "--input", src, "--output-prefix", tmp_path / "out",
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", 100, "--append-eod")
    assert code == 0, err
    assert read_documents(tmp_path / "out_text_document") == [[1, 2, 3, 100], [4, 100]]
    assert any("2 documents" in line and "3 empty documents skipped" in line for line in err), err


def _truncated_gzip() -> tuple[bytes, int]:
    """A gzip'd JSONL cut short, and the first line it cannot deliver (found by zlib)."""
    content = "".join(json.dumps({"text": " ".join(str(i % 9 + 1) for i in range(n % 50))}) + "\n"
                      for n in range(4000)).encode()
    packed = gzip.compress(content, mtime=0)
    truncated = packed[:len(packed) * 3 // 5]
    complete = zlib.decompressobj(wbits=31).decompress(truncated).count(b"\n")
    assert 0 < complete < 4000
    return truncated, complete + 1


TRUNCATED_GZIP, TRUNCATED_GZIP_LINE = _truncated_gzip()

BAD_INPUTS = {
    # name: (file name, file bytes, line, exact reason or fragment, documents kept by --skip-bad-lines,
    #        or None where the damage is fatal even then)
    "malformed json": ("in.jsonl", b'{"text": "1"}\n{"text": "2"}\n{"text": "3" "x"}\n', 3,
                       "malformed JSON: Expecting ',' delimiter at column 14", [[1], [2]]),
    "json line ends early": ("in.jsonl", b'{"text": "1"}\n{"text": "3"\n', 2,
                             "malformed JSON: Expecting ',' delimiter at column 13 (end of line)", [[1]]),
    "missing key": ("in.jsonl", b'{"text": "1"}\n{"body": "2"}\n{"text": "3"}\n', 2, "missing key 'text'",
                    [[1], [3]]),
    "not a string": ("in.jsonl", b'{"text": "1"}\n{"text": 5}\n', 2, "holds int, expected a string", [[1]]),
    "not an object": ("in.jsonl", b'["text"]\n{"text": "4"}\n', 1, "expected a JSON object", [[4]]),
    "lone surrogate": ("in.jsonl", b'{"text": "1"}\n{"text": "\xc3\xa9 \\ud800"}\n', 2, "lone surrogate \\ud800",
                       [[1]]),
    "invalid utf-8 jsonl": ("in.jsonl", b'{"text": "1"}\n{"text": "b\xff"}\n', 2, "invalid UTF-8", [[1]]),
    "invalid utf-8 text": ("in.txt", b"1\n2 3\nbad \xc3\x28 byte\n", 3, "invalid UTF-8", [[1], [2, 3]]),
    "invalid utf-8 gzip": ("in.jsonl.gz", gzip.compress(b'{"text": "1"}\n\n{"text": "\xfe"}\n', mtime=0), 3,
                           "invalid UTF-8", [[1]]),
    "invalid utf-8 document per file": ("in.txt", b"line one\nline two \xe2\x82\n", 2, "invalid UTF-8", []),
    "tokenizer refuses": ("in.txt", b"1 2\n3 4\n5 x6\n7\n", 3, "tokenizer refused the text: NullTokenizer: 'x6'",
                          [[1, 2], [3, 4], [7]]),
    "truncated gzip": ("in.jsonl.gz", TRUNCATED_GZIP, TRUNCATED_GZIP_LINE,
                       "gzip file is truncated (it ends before the end-of-stream marker)", None),
    "truncated gzip document per file": ("in.txt.gz", TRUNCATED_GZIP[:len(TRUNCATED_GZIP) // 2], 1,
                                         "gzip file is truncated", None),
    "not gzip": ("in.jsonl.gz", b'{"text": "1"}\n', 1, "not a gzip file (Not a gzipped file (b'{\"'))", None),
}
BLANK_LINES = {"invalid utf-8 gzip": 1}


def run_bad_input(tool, capsys, tmp_path, case, *flags):
    """Write the case's file and preprocess it; return (file, output dir, exit code, stderr lines)."""
    name, content, *_ = BAD_INPUTS[case]
    path = tmp_path / name
    path.write_bytes(content)
    out = tmp_path / "out"
    out.mkdir()
    mode = ["--text-mode", "file"] if case.endswith("per file") else []
    code, err = run(tool, capsys, "--input", path, "--output-prefix", out / "ds",
                    "--tokenizer-type", "NullTokenizer", "--vocab-size", 10, *mode, *flags)
    return path, out, code, err


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_stops_with_file_line_and_reason_and_leaves_no_output(tool, capsys, tmp_path, case):
    _, _, line, reason, _ = BAD_INPUTS[case]
    path, out, code, err = run_bad_input(tool, capsys, tmp_path, case)
    assert code == 1
    assert len(err) == 1 and err[0].startswith(f"error: {path}:{line}: ") and reason in err[0], err
    assert os.listdir(out) == []  # no final names, no temporary files


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_skip_bad_lines_skips_and_counts_each_bad_line_once(tool, capsys, tmp_path, case):
    _, _, line, reason, kept = BAD_INPUTS[case]
    path, out, code, err = run_bad_input(tool, capsys, tmp_path, case, "--skip-bad-lines")
    if kept is None:  # a damaged file is not a bad line: it stops the run all the same
        assert code == 1 and len(err) == 1 and err[0].startswith(f"error: {path}:{line}: ") and reason in err[0]
        assert os.listdir(out) == []
        return
    assert code == 0, err
    assert read_documents(out / "ds_text_document") == kept
    empty = BLANK_LINES.get(case, 0)
    assert f"{len(kept)} documents, {sum(map(len, kept))} tokens from 1 files; {empty} empty documents skipped" \
        in err, err
    assert err[-2].startswith("skipped 1 bad lines (1 ") and f"), first: {path}:{line}: " in err[-2], err
    assert reason in err[-2], err
    assert sorted(os.listdir(out)) == ["ds_text_document.bin", "ds_text_document.idx"]


def test_line_numbers_are_exact_in_later_shards_and_skip_bad_lines_counts(tool, capsys, tmp_path):
    path = tmp_path / "big.txt"
    lines = [f"{i} {i + 1}" for i in range(200_000)]
    lines[150_001] = "bad \xff".encode("latin-1").decode("latin-1")
    with open(path, "wb") as f:
        for i, text in enumerate(lines):
            f.write(text.encode("latin-1" if i == 150_001 else "utf-8") + b"\n")
    null = ["--tokenizer-type", "NullTokenizer", "--vocab-size", 300_000]
    code, err = run(tool, capsys, "--input", path, "--output-prefix", tmp_path / "ds", *null,
                    "--partitions", 7, "--workers", 2)
    assert code == 1 and err[-1].startswith(f"error: {path}:150002: invalid UTF-8"), err
    assert sorted(os.listdir(tmp_path)) == ["big.txt"]
    code, err = run(tool, capsys, "--input", path, "--output-prefix", tmp_path / "ds", *null,
                    "--partitions", 7, "--skip-bad-lines")
    assert code == 0, err
    assert any(line.startswith(f"skipped 1 bad lines (1 invalid UTF-8 at byte N of the line), first: {path}:150002: "
                               "invalid UTF-8") for line in err), err
    ds = IndexedDataset(str(tmp_path / "ds_text_document"))
    assert len(ds) == 199_999 and ds[150_001].tolist() == [150_002, 150_003]


def test_flag_errors_name_the_flag(tool, capsys, tmp_path, sp_model):
    code, err = run(tool, capsys, "--input", tmp_path / "nothing*.jsonl", "--output-prefix", tmp_path / "x",
                    *sp_args(sp_model))
    assert code == 1 and "--input" in err[-1] and "no such file" in err[-1]
    (tmp_path / "in.jsonl").write_text('{"text": "a"}\n')
    code, err = run(tool, capsys, "--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "no/dir/x",
                    *sp_args(sp_model))
    assert code == 1 and "--output-prefix" in err[-1]
    code, err = run(tool, capsys, "--input", tmp_path / "in.jsonl", "--output-prefix", tmp_path / "x",
                    "--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", tmp_path / "missing.model")
    assert code == 1 and "--tokenizer-model" in err[-1] and "missing.model" in err[-1]
    assert sorted(os.listdir(tmp_path)) == ["in.jsonl"]
