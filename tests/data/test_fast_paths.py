"""The fast encoders (tiktoken's Rust BPE, chunk caches) give the models' own ids exactly,
and the checks that gate the tiktoken path reject the models it would get wrong."""

import json
import random

import numpy as np
import pytest

from megalite.data.gpt2_bpe import bytes_to_unicode
from megalite.data.tokenizers import build_tokenizer
from tests.data.conftest import load_tool
from tests.data.test_tokenizers import EDGE_TEXTS, random_texts


def ascii_texts(seed, count=300):
    """ASCII with the cases the tiktoken paths rewrite: whitespace runs of every kind before
    words, contractions, digits, punctuation, trailing spaces."""
    rng = random.Random(seed)
    alphabet = list("ab cd  ef\n\t.,'s") + ["  ", "\n    ", " \n", "\r\n", "'re", "'ll", "9", "00", "_", "\x0b"]
    return ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 40))) for _ in range(count)]


def encoded(tok, texts, batch=37):
    out = []
    for i in range(0, len(texts), batch):  # batches share caches, as in preprocessing
        out += [np.frombuffer(b, np.int32).tolist() for b in tok.encode_batch_bytes(texts[i:i + batch])]
    return out


@pytest.mark.parametrize("path", ["tiktoken", "chunk cache"])
def test_fast_paths_equal_plain_encoding(sp_model, gpt2_files, demo_texts, path):
    vocab, merges, _ = gpt2_files
    sp = build_tokenizer("SentencePieceTokenizer", tokenizer_model=sp_model)
    gpt2 = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert sp.chunking == "fine"  # train_tokenizer.py models qualify for the finest chunk cache
    assert sp._tiktoken is not None and gpt2.bpe._tiktoken is not None  # and for tiktoken
    if path == "chunk cache":
        sp._tiktoken = gpt2.bpe._tiktoken = None
    texts = demo_texts + EDGE_TEXTS + random_texts(0) + ascii_texts(1) + ["a\x00  b", "\x00", "a \x00"]
    for tok in (sp, gpt2):
        assert encoded(tok, texts) == [tok.encode_reference(t) for t in texts]
        assert [tok.encode(t) for t in EDGE_TEXTS] == [tok.encode_reference(t) for t in EDGE_TEXTS]


def test_sentencepiece_tiktoken_path_builds_characters_from_bytes(tmp_path, demo_texts):
    """Characters of 3-4 UTF-8 bytes are assembled from byte prefixes; an unknown character
    that shares a prefix with a known one leaves that prefix, which is no piece: such a
    document falls back to SentencePiece itself."""
    tool = load_tool("train_tokenizer")
    special = ["na\u00efve caf\u00e9 \u2014 \u201cquoted\u201d \u65e5\u672c\u8a9e \U0001f389 \u2581mark"] * 40
    tool.train_sentencepiece(demo_texts[:100] + special, str(tmp_path / "u"), 500)
    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(tmp_path / "u.model"))
    assert tok._tiktoken is not None
    known = {tok.sp.id_to_piece(i) for i in range(tok.vocab_size)}
    assert "\u2014" in known and "\u2020" not in known  # em dash known, dagger (same first two bytes) not
    assert tok._encode_tiktoken(["a\u2020b"], "word") == [None]
    rng = random.Random(3)
    alphabet = list("ab c\u00e9\u00ef\u2014\u2020\u201c\u65e5\u65e6\u672c\U0001f389\U0001f38a\u2581 \n") + ["  "]
    texts = ["".join(rng.choice(alphabet) for _ in range(rng.randint(0, 30))) for _ in range(400)]
    texts += special[:1] + EDGE_TEXTS
    assert encoded(tok, texts) == [tok.encode_reference(t) for t in texts]


def write_gpt2_files(directory, merges):
    """vocab.json (<|endoftext|>, the 256 byte symbols, then merge results) and merges.txt."""
    vocab = {"<|endoftext|>": 0}
    for c in bytes_to_unicode().values():
        vocab[c] = len(vocab)
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    directory.mkdir()
    (directory / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (directory / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges),
                                          encoding="utf-8")
    return str(directory / "vocab.json"), str(directory / "merges.txt")


def test_gpt2_tiktoken_checks_reject_merges_it_would_get_wrong(tmp_path):
    """Random merge lists over a few symbols (some out of order): wherever the checks let
    tiktoken in, its ids equal GPT-2's merging; a list where it would differ is rejected."""
    # b+c merges first, then a+b and ab+c: GPT-2 stops 'abc' at [a, bc]; merging any
    # concatenation that is a token (as tiktoken does) would go on to 'abc'.
    # ab+a ranks before a+b: GPT-2 merges every a+b of 'abab' at once, giving [ab, ab];
    # merging one occurrence at a time (as tiktoken does) would make 'aba' first.
    # A merge with the NUL byte (\u0100) would break the NUL marker of the fast path.
    for name, merges, text, expected in (("abc", [("b", "c"), ("a", "b"), ("ab", "c")], "abc", ["a", "bc"]),
                                         ("abab", [("ab", "a"), ("a", "b")], "abab", ["ab", "ab"]),
                                         ("nul", [("a", "\u0100")], "a  b", ["a", "\u0120", "\u0120", "b"])):
        vocab, merges_file = write_gpt2_files(tmp_path / name, merges)
        tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges_file)
        assert tok.bpe._tiktoken is None
        assert tok.encode(text) == tok.encode_reference(text) == [tok.bpe.encoder[s] for s in expected]
    rng = random.Random(0)
    accepted = 0
    for case in range(120):
        symbols, merges = ["a", "b", "c", "\u0120"], []  # \u0120: the byte symbol of a space
        for _ in range(rng.randint(3, 14)):
            a, b = rng.choice(symbols), rng.choice(symbols)
            if a + b not in symbols:
                merges.append((a, b))
                symbols.append(a + b)
        if case % 3 == 0:  # some merges then use symbols that later merges make
            i, j = rng.sample(range(len(merges)), 2)
            merges[i], merges[j] = merges[j], merges[i]
        vocab, merges_file = write_gpt2_files(tmp_path / f"case{case}", merges)
        tok = build_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges_file)
        accepted += tok.bpe._tiktoken is not None
        texts = ["".join(rng.choice("abc  \n") for _ in range(rng.randint(0, 24))) for _ in range(30)]
        assert encoded(tok, texts) == [tok.encode_reference(t) for t in texts], merges
    assert 20 < accepted < 110  # both outcomes are exercised


def test_sentencepiece_tiktoken_checks_follow_the_scores(tmp_path, sp_model, demo_texts):
    """Pieces whose scores no longer let them encode to themselves, or tied scores, keep
    the chunk cache; wherever the checks pass, the ids equal SentencePiece's."""
    from megalite.data.sentencepiece_tokenizer import PIECE_NORMAL, parse_model

    with open(sp_model, "rb") as f:
        original = f.read()
    rng = random.Random(5)
    texts = demo_texts[:40] + ascii_texts(6, 200) + random_texts(7, 100)
    outcomes = set()
    for case, swaps in enumerate([0, 1, 2, 3, 40, "tie"]):
        proto = parse_model(original)
        merged = [p for p in proto.pieces if p.type == PIECE_NORMAL and len(p.piece) > 1]
        if swaps == "tie":
            merged[10].score = merged[11].score
        for _ in range(swaps if swaps != "tie" else 0):
            p, q = rng.sample(merged, 2)
            p.score, q.score = q.score, p.score
        path = tmp_path / f"m{case}.model"
        path.write_bytes(proto.SerializeToString())
        tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model=str(path))
        outcomes.add((swaps, tok._tiktoken is not None))
        assert encoded(tok, texts) == [tok.encode_reference(t) for t in texts], swaps
    assert (0, True) in outcomes and (40, False) in outcomes and ("tie", False) in outcomes
