"""Every tokenizer type round-trips; the cached fast paths equal plain tokenisation exactly."""

import json
import os
import random

import numpy as np
import pytest

from megalite.data.tokenizers import TOKENIZER_TYPES, build_tokenizer
from tests.data.conftest import load_tool

ROUND_TRIP_TEXTS = [
    "Hello world, it's a test.", "  leading and trailing  ", "tabs\tand\nnewlines\r\n",
    "ünïcödé — 日本語 🎉 emoji", "x = f(a, b)  # comment\n    return x", "", "a",
]
# Strings that probe the whitespace rules the chunk caches rely on.
EDGE_TEXTS = ["", " ", "  ", "a ", "a  ", " a", "  a", "a \n", "\n\n  x\ty\u3000z \u00a0w", "x\x1cy\x85z\x00",
              "it's  don't'll", "   \n", "\u2581x \u2581\u2581y\u2581", "x" * 3000 + " y", "1234567 89"]


def tokenizers_of_every_type(sp_model, gpt2_files, tiktoken_file):
    vocab, merges, hf_json = gpt2_files
    return {
        "GPT2BPETokenizer": build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges),
        "SentencePieceTokenizer": build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model),
        "GPTSentencePieceTokenizer": build_tokenizer("GPTSentencePieceTokenizer", tokenizer_model=sp_model),
        "Llama2Tokenizer": build_tokenizer("Llama2Tokenizer", tokenizer_model=sp_model),
        "HuggingFaceTokenizer": build_tokenizer("HuggingFaceTokenizer", tokenizer_model=hf_json),
        "TikTokenizer": build_tokenizer("TikTokenizer", tokenizer_model=tiktoken_file),
        "NullTokenizer": build_tokenizer("NullTokenizer", vocab_size=1000),
    }


def test_every_type_round_trips_and_has_the_interface(sp_model, gpt2_files, tiktoken_file):
    toks = tokenizers_of_every_type(sp_model, gpt2_files, tiktoken_file)
    assert set(toks) == set(TOKENIZER_TYPES)
    for name, tok in toks.items():
        texts = ["1 2 3", "999", "", "0 0 7"] if name == "NullTokenizer" else ROUND_TRIP_TEXTS
        for text in texts:
            ids = tok.encode(text)
            assert all(isinstance(i, int) and 0 <= i < tok.vocab_size for i in ids), name
            assert tok.decode(ids) == (" ".join(text.split()) if name == "NullTokenizer" else text), (name, text)
        assert 0 <= tok.eod < tok.vocab_size and 0 <= tok.pad < tok.vocab_size
        batch = tok.encode_batch_bytes(texts)
        assert [np.frombuffer(b, np.int32).tolist() for b in batch] == [tok.encode(t) for t in texts], name
    assert toks["NullTokenizer"].eod == 1000 and toks["NullTokenizer"].vocab_size == 1001  # as Megatron
    assert toks["SentencePieceTokenizer"].eod == 2  # </s>, as train_tokenizer.py lays the ids out
    assert toks["GPT2BPETokenizer"].eod == 0  # <|endoftext|>
    assert toks["TikTokenizer"].eod == 2 and toks["TikTokenizer"].vocab_size == 1000 + 599


def test_gpt2_bpe_matches_hugging_face_byte_level_bpe(gpt2_files, demo_texts):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab, merges, _ = gpt2_files
    ours = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    hf = Tokenizer(models.BPE.from_file(vocab, merges))
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    for text in demo_texts[:150] + EDGE_TEXTS:
        assert ours.encode(text) == hf.encode(text).ids, text[:50]


def test_gpt2_ascii_pattern_equals_the_regex_pattern():
    import re

    import regex

    from megalite.data.gpt2_bpe import GPT2_ASCII_PATTERN, GPT2_PATTERN

    full, ascii_only = regex.compile(GPT2_PATTERN), re.compile(GPT2_ASCII_PATTERN, re.ASCII)
    rng = random.Random(2)
    alphabet = [chr(i) for i in range(128)] + ["'s", "'re", "'ll", " 've", "  ", "\n\n"]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60))) for _ in range(3000)]
    for text in texts + EDGE_TEXTS[:8] + ["it's  don't'll 'RE 'Ve x'd"]:
        if text.isascii():
            assert ascii_only.findall(text) == full.findall(text), repr(text)


def random_texts(seed, count=300):
    rng = random.Random(seed)
    alphabet = list("ab cd  ef\n\t.,'s") + ["\u2581", "\u3000", "é", "日", "🎉", "\x85", "\x1c", "0", "9"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(count)]


def test_sentencepiece_chunking_follows_the_model(data_dir, demo_texts):
    import sentencepiece as spm

    common = dict(vocab_size=800, model_type="bpe", minloglevel=2)
    # pieces may mix letters, digits and punctuation (no script or number splitting): words only
    mixed = str(data_dir / "mixed")
    spm.SentencePieceTrainer.train(**common, sentence_iterator=iter(demo_texts[:200]), model_prefix=mixed,
                                   byte_fallback=True, normalization_rule_name="identity",
                                   remove_extra_whitespaces=False, split_by_unicode_script=False,
                                   split_digits=False, split_by_number=False)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=mixed + ".model")
    assert tok.chunking == "word"
    texts = demo_texts[:40] + EDGE_TEXTS + random_texts(1, 100)
    assert [np.frombuffer(b, np.int32).tolist() for b in tok.encode_batch_bytes(texts)] == \
        [tok.encode_reference(t) for t in texts]
    # the default normaliser (nmt_nfkc, extra whitespace removed) rules chunking out
    nfkc = str(data_dir / "nfkc")
    spm.SentencePieceTrainer.train(**common, sentence_iterator=iter(demo_texts[:60]), model_prefix=nfkc)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=nfkc + ".model")
    assert tok.chunking is None and tok._cache is None
    text = "Some  text   with  spaces"
    assert tok.encode(text) == tok.sp.encode(text)


def test_chunk_pattern_classes_agree_with_char_kind():
    import re

    from megalite.data.sentencepiece_tokenizer import CHUNK_PATTERNS, char_kind

    letter, digit = re.compile(r"[^\W\d_]"), re.compile(r"\d")
    for cp in list(range(0x30000)) + list(range(0xE0000, 0xE0200)):
        c = chr(cp)
        expected = ("S" if c in " \u2581" else "D" if digit.match(c) else "L" if letter.match(c) else "O")
        assert char_kind(c) == expected, hex(cp)
    text = " ab12_c.(d)  ef\u3000g9\t "
    assert CHUNK_PATTERNS["fine"].findall(text) == [" ab", "12", "_", "c", ".(", "d", ")", "  ef", "\u3000", "g",
                                                    "9", "\t", " "]


def test_train_tokenizer_is_deterministic_and_reads_text_files(tmp_path, demo_corpus, demo_texts):
    tool = load_tool("train_tokenizer")
    a, b = str(tmp_path / "a"), str(tmp_path / "b")
    tool.main(["--input", demo_corpus, "--vocab-size", "400", "--model-prefix", a])
    tool.main(["--input", demo_corpus, "--vocab-size", "400", "--model-prefix", b])
    assert open(a + ".model", "rb").read() == open(b + ".model", "rb").read()
    assert sorted(os.listdir(tmp_path)) == ["a.model", "a.vocab", "b.model", "b.vocab"]
    txt = tmp_path / "corpus.txt"
    txt.write_text("\n".join(t.replace("\n", " ") for t in demo_texts[:100]), encoding="utf-8")
    tool.main(["--input", str(txt), "--vocab-size", "500", "--model-prefix", str(tmp_path / "t")])
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "t.model"))
    assert tok.vocab_size == 500 and tok.decode(tok.encode("byte fallback: ☃")) == "byte fallback: ☃"


def test_bad_or_missing_files_name_the_flag_and_path(tmp_path, sp_model, gpt2_files):
    vocab, merges, hf_json = gpt2_files
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x80\x81 not a model")
    bad_merges = tmp_path / "merges.txt"
    bad_merges.write_text("#version: 0.2\nĠ t\nthree symbols here\n", encoding="utf-8")
    no_eod = tmp_path / "vocab.json"
    with open(vocab, encoding="utf-8") as f:
        v = json.load(f)
    v.pop("<|endoftext|>")
    no_eod.write_text(json.dumps(v), encoding="utf-8")
    cases = [
        (("SentencePieceTokenizer",), dict(tokenizer_model=str(tmp_path / "nope.model")), "--tokenizer-model",
         "not found"),
        (("SentencePieceTokenizer",), dict(tokenizer_model=str(junk)), "--tokenizer-model", "not a SentencePiece"),
        (("SentencePieceTokenizer",), {}, "--tokenizer-model", "needs"),
        (("GPT2BPETokenizer",), dict(vocab_file=str(junk), merge_file=merges), "--vocab-file", "not a JSON"),
        (("GPT2BPETokenizer",), dict(vocab_file=vocab, merge_file=str(bad_merges)), "--merge-file", ":3: expected two"),
        (("GPT2BPETokenizer",), dict(vocab_file=str(no_eod), merge_file=merges), "--vocab-file", "<|endoftext|>"),
        (("GPT2BPETokenizer",), dict(vocab_file=vocab), "--merge-file", "needs"),
        (("HuggingFaceTokenizer",), dict(tokenizer_model=str(junk)), "--tokenizer-model", "not a Hugging Face"),
        (("HuggingFaceTokenizer",), dict(tokenizer_model=str(tmp_path)), "--tokenizer-model", "no tokenizer.json"),
        (("TikTokenizer",), dict(tokenizer_model=merges), "--tokenizer-model", "not a tiktoken rank file"),
        (("NullTokenizer",), {}, "--vocab-size", "needs"),
        (("BertTokenizer",), {}, "--tokenizer-type", "not one of"),
    ]
    for args, kwargs, flag, message in cases:
        with pytest.raises(ValueError) as err:
            build_tokenizer(*args, **kwargs)
        text = str(err.value)
        assert flag in text and message in text, text
        for path in kwargs.values():
            if path != vocab and path != merges:
                assert path in text, text
    with pytest.raises(ValueError, match="'x7' is not an integer id"):
        build_tokenizer("NullTokenizer", vocab_size=10).encode("1 x7")


def test_hugging_face_eod_comes_from_tokenizer_config(tmp_path, gpt2_files):
    import shutil

    shutil.copy(gpt2_files[2], tmp_path / "tokenizer.json")
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "<|endoftext|>"}}))
    tok = build_tokenizer("HuggingFaceTokenizer", tokenizer_model=str(tmp_path))
    assert tok.eod == 0 and tok.vocab_size == 600


def test_demo_corpus_is_deterministic_and_sized(tmp_path):
    tool = load_tool("make_demo_corpus")
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    tool.main(["--output", str(a), "--max-mb", "0.2"])
    tool.main(["--output", str(b), "--max-mb", "0.2"])
    assert a.read_bytes() == b.read_bytes()
    assert 0.1e6 < a.stat().st_size <= 0.2e6
    docs = [json.loads(line)["text"] for line in a.read_text(encoding="utf-8").splitlines()]
    assert len(docs) > 10 and all(d.strip() for d in docs)
    assert sorted(os.listdir(tmp_path)) == ["a.jsonl", "b.jsonl"]


def test_demo_corpus_says_when_the_standard_library_runs_out(tmp_path, monkeypatch, capsys):
    tool = load_tool("make_demo_corpus")
    library = tmp_path / "lib"
    library.mkdir()
    (library / "one.py").write_text('"""One module."""\nx = 1\n')
    (library / "two.py").write_text('"""Two module."""\ny = 2\n')
    assert tool.write_demo_corpus(str(tmp_path / "all.jsonl"), 10**6, str(library))[2]
    docs, written, ran_out = tool.write_demo_corpus(str(tmp_path / "some.jsonl"), 60, str(library))
    assert docs == 1 and not ran_out
    monkeypatch.setattr(tool, "write_demo_corpus", lambda output, max_bytes: (3, 11_800_000, True))
    tool.main(["--output", str(tmp_path / "big.jsonl"), "--max-mb", "20"])
    assert "gives only 11.80 MB, less than --max-mb 20" in capsys.readouterr().err
