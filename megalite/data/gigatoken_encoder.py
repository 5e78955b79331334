"""Tokenising through gigatoken (Rust) where it is installed and gives the tokenizer's own ids.

`gigatoken_encoder` builds gigatoken's tokenizer from the same files as megalite's
SentencePiece, GPT-2 BPE or Hugging Face tokenizer, and keeps it only if it encodes a set of
probe texts (Unicode classes, whitespace runs, digits, contractions, byte fallback) and a
sample of the input itself to exactly the tokenizer's own ids; otherwise (or for a
TikTokenizer, whose Megatron patterns gigatoken does not carry) the tokenizer's own library
path is used and the reason is reported. Preprocessing workers each encode on their own
thread (gigatoken's thread pool is never touched, so worker processes compose and forking
is safe).
"""

import json
import os

import numpy as np

PROBE_TEXTS = [
    "Hello world! It's a test: don't, we'll, they're, I'm, you've, she'd.",
    "  leading and trailing spaces   ", "tabs\tand\nnew\r\nlines\n\n\nand   runs  of   spaces \n ",
    "digits 1234567890 3.14159 1e-9 0x1F 2026-11-25", "café naïve Zürich déjà vu Ærøskøbing",
    "日本語のテキストと中文文本", "emoji 🙂🚀👍🏽 and symbols ©®™ ∑∫√ ≠ ≤", "Ελληνικά Русский текст العربية עברית",
    "combining e\u0301 and zero\u200bwidth and \u2581 lower one eighth block", "\x00NUL and \x7fDEL",
    "def f(x):\n    return x ** 2  # comment\n", '{"key": [1, 2, 3], "nested": {"a": null}}', "a", "",
    "ALLCAPS lowercase MixedCase camelCase snake_case kebab-case",
    "special-token text stays text: <|endoftext|> </s> <s> <unk> <pad>",
]
SAMPLE_BYTES = 1 << 16
FOUR_BYTE_IDS = (np.dtype(np.uint32), np.dtype(np.int32))


class GigatokenEncoder:
    """encode_batch_bytes(texts) -> int32 id bytes per text, through a gigatoken Tokenizer.

    gigatoken reads its special tokens (SentencePiece's <s>, </s>, <pad>; tokenizer.json's
    added special tokens) in text as those tokens, where SentencePiece reads them as text:
    the rare text that contains one goes through the tokenizer's own path (`library`)."""

    def __init__(self, tokenizer, version: str, library, specials: list[str]):
        self.tokenizer, self.version, self.library, self.specials = tokenizer, version, library, specials
        self.backend = tokenizer.backend  # the Rust tokenizer: encode() on the calling thread, no pool

    def encode_batch_bytes(self, texts: list[str]) -> list[bytes]:
        if not texts:
            return []
        special = [i for i, t in enumerate(texts) if any(s in t for s in self.specials)] if self.specials else []
        if not special:
            return self._encode(texts)
        routed = set(special)
        plain = [i for i in range(len(texts)) if i not in routed]
        out = [b""] * len(texts)
        for indices, encoded in ((plain, self._encode([texts[i] for i in plain])),
                                 (special, self.library.encode_batch_bytes([texts[i] for i in special]))):
            for i, ids in zip(indices, encoded):
                out[i] = ids
        return out

    def _encode(self, texts: list[str]) -> list[bytes]:
        # one call per text: encode_batch returns an awkward Array, whose import alone costs
        # more than a megabyte of encoding; per text, the call itself is a microsecond
        # ids below 2**31 have the same bytes as uint32 (gigatoken's dtype) and int32: no cast
        encode, same = self.backend.encode, FOUR_BYTE_IDS
        return [ids.tobytes() if ids.dtype in same else ids.astype(np.int32).tobytes() for ids in map(encode, texts)]


def gigatoken_module():
    try:
        import gigatoken
    except ImportError:
        return None
    return gigatoken


def _gpt2_tokenizer_json(vocab_file: str, merge_file: str) -> str:
    """The tokenizer.json of GPT-2's byte-level BPE over these files (no added tokens: the
    end-of-document token is appended by id, never encoded from text)."""
    with open(vocab_file, encoding="utf-8") as f:
        vocab = json.load(f)
    with open(merge_file, encoding="utf-8") as f:
        merges = [line.rstrip("\n") for line in f if line.strip() and not line.startswith("#version")]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return json.dumps({
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": [], "normalizer": None,
        "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                  "merges": merges}})


def _build(gigatoken, tokenizer_type: str, tokenizer_model, vocab_file, merge_file):
    if tokenizer_type == "SentencePieceTokenizer":
        return gigatoken.Tokenizer.from_sentencepiece(tokenizer_model)
    if tokenizer_type == "GPT2BPETokenizer":
        return gigatoken.Tokenizer.from_json(_gpt2_tokenizer_json(vocab_file, merge_file))
    if tokenizer_type == "HuggingFaceTokenizer":
        file = os.path.join(tokenizer_model, "tokenizer.json") if os.path.isdir(tokenizer_model) else tokenizer_model
        with open(file, "rb") as f:
            return gigatoken.Tokenizer.from_json(f.read())
    return None


def gigatoken_encoder(tokenizer, tokenizer_type: str, *, tokenizer_model=None, vocab_file=None, merge_file=None,
                      sample: list[str] = ()) -> tuple[GigatokenEncoder | None, str]:
    """(encoder, why) where encoder is None unless gigatoken is installed, supports this
    tokenizer and gives `tokenizer`'s ids on the probe texts and `sample`."""
    gigatoken = gigatoken_module()
    if gigatoken is None:
        return None, "gigatoken is not installed"
    version = getattr(gigatoken, "__version__", None) or _dist_version()
    try:
        built = _build(gigatoken, tokenizer_type, tokenizer_model, vocab_file, merge_file)
    except Exception as e:  # gigatoken raises its own types for models it does not support
        return None, f"gigatoken {version} cannot load this {tokenizer_type} ({str(e).splitlines()[0][:200]})"
    if built is None:
        return None, f"gigatoken does not carry {tokenizer_type}'s pre-tokenisation"
    special_tokens = getattr(built, "_special_tokens", dict)()
    specials = sorted(str(t) for t in special_tokens if t)
    encoder = GigatokenEncoder(built, version, tokenizer, specials)
    added = _added_tokens(tokenizer_type, tokenizer_model)  # each probed in text, special or not
    texts = PROBE_TEXTS + [f"a {t} b{t}" for t in sorted(set(specials) | set(added))] + list(sample)
    theirs = encoder.encode_batch_bytes(texts)
    ours = tokenizer.encode_batch_bytes(texts)
    for text, a, b in zip(texts, theirs, ours):
        if a != b:
            a, b = np.frombuffer(a, np.int32), np.frombuffer(b, np.int32)
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            return None, (f"gigatoken {version} gives other ids than {tokenizer_type} for {text[:40]!r} "
                          f"(from token {at}: {a[at:at + 4].tolist()} vs {b[at:at + 4].tolist()})")
    return encoder, (f"gigatoken {version}, ids checked against {tokenizer_type} on {len(PROBE_TEXTS)} probe "
                     f"texts and {len(sample)} input documents")


def _added_tokens(tokenizer_type: str, tokenizer_model) -> list[str]:
    if tokenizer_type != "HuggingFaceTokenizer":
        return []
    file = os.path.join(tokenizer_model, "tokenizer.json") if os.path.isdir(tokenizer_model) else tokenizer_model
    with open(file, encoding="utf-8") as f:
        return [str(t.get("content", "")) for t in json.load(f).get("added_tokens") or [] if t.get("content")]


def _dist_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("gigatoken")
    except PackageNotFoundError:
        return "(unknown version)"


def sample_documents(documents, limit: int = SAMPLE_BYTES) -> list[str]:
    """The first documents' texts (every key's) up to about `limit` bytes, for the check."""
    out, size = [], 0
    for texts in documents:
        out.extend(texts)
        size += sum(len(t) for t in texts)
        if size >= limit:
            break
    return out
