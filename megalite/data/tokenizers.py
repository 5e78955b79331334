"""Tokenizers behind one interface, built by Megatron's --tokenizer-type names.

Every tokenizer has .vocab_size, .eod, .pad, .encode(str) -> list[int], .decode(ids) -> str
and .encode_batch_bytes(list[str]) -> list[bytes] (int32 ids, what preprocessing writes).

    tok = build_tokenizer("SentencePieceTokenizer", tokenizer_model="tok.model")
"""

import base64
import json
import os
from array import array

import numpy as np

from megalite.data.tokenizer_support import require_package

TOKENIZER_TYPES = ("GPT2BPETokenizer", "SentencePieceTokenizer", "GPTSentencePieceTokenizer",
                   "Llama2Tokenizer", "HuggingFaceTokenizer", "TikTokenizer", "NullTokenizer")
SENTENCEPIECE_TYPES = ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")


def build_tokenizer(tokenizer_type: str, *, tokenizer_model: str | None = None,
                    vocab_file: str | None = None, merge_file: str | None = None,
                    vocab_size: int | None = None, vocab_extra_ids: int = 0, **options):
    """Build a tokenizer by Megatron type name. Bad or missing files raise ValueError naming
    the flag and the path. `vocab_extra_ids` (SentencePieceTokenizer only, as in Megatron):
    sentinel tokens appended to the vocabulary. `options` (TikTokenizer only): tiktoken_pattern
    ('v1'/'v2'), tiktoken_num_special_tokens (1000), tiktoken_special_tokens."""
    if vocab_extra_ids and tokenizer_type != "SentencePieceTokenizer":
        raise ValueError(f"--vocab-extra-ids applies only to --tokenizer-type SentencePieceTokenizer "
                         f"(got {tokenizer_type})")
    if tokenizer_type == "GPT2BPETokenizer":
        from megalite.data.gpt2_bpe import EOD_TOKEN, GPT2BPE

        _require("--vocab-file", vocab_file, tokenizer_type)
        _require("--merge-file", merge_file, tokenizer_type)
        return _GPT2Tokenizer(GPT2BPE(vocab_file, merge_file), EOD_TOKEN)
    if tokenizer_type in SENTENCEPIECE_TYPES:
        from megalite.data import sentencepiece_variants as variants

        _require("--tokenizer-model", tokenizer_model, tokenizer_type)
        if tokenizer_type == "SentencePieceTokenizer":
            if vocab_extra_ids:
                return variants.SentencePieceWithExtraIds(tokenizer_model, vocab_extra_ids)
            return variants.SentencePieceTokenizer(tokenizer_model)
        return getattr(variants, tokenizer_type)(tokenizer_model)
    if tokenizer_type == "HuggingFaceTokenizer":
        _require("--tokenizer-model", tokenizer_model, tokenizer_type)
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "TikTokenizer":
        _require("--tokenizer-model", tokenizer_model, tokenizer_type)
        return TikTokenizer(tokenizer_model, vocab_size=vocab_size, **options)
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("--tokenizer-type NullTokenizer needs --vocab-size")
        return NullTokenizer(vocab_size)
    raise ValueError(f"--tokenizer-type {tokenizer_type!r} is not one of {', '.join(TOKENIZER_TYPES)}")


def _require(flag: str, value, tokenizer_type: str) -> None:
    if not value:
        raise ValueError(f"--tokenizer-type {tokenizer_type} needs {flag}")


class Tokenizer:
    """Shared defaults: batch encoding by looping over encode()."""

    vocab_size: int
    eod: int
    pad: int

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids) -> str:
        raise NotImplementedError

    def encode_batch_bytes(self, texts: list[str]) -> list[bytes]:
        return [array("i", self.encode(t)).tobytes() for t in texts]


class _GPT2Tokenizer(Tokenizer):
    """Megatron's GPT2BPETokenizer: eod (and pad) is <|endoftext|>."""

    def __init__(self, bpe, eod_token: str):
        self.bpe = bpe
        self.vocab_size = len(bpe.encoder)
        if eod_token not in bpe.encoder:
            raise ValueError(f"--vocab-file {bpe.vocab_file}: no {eod_token} entry (the end-of-document token)")
        self.eod = self.pad = bpe.encoder[eod_token]

    def encode(self, text):
        return self.bpe.encode(text)

    def encode_reference(self, text):
        return self.bpe.encode_reference(text)

    def encode_batch_bytes(self, texts):
        return self.bpe.encode_batch_bytes(texts)

    def decode(self, ids):
        return self.bpe.decode(ids)


class NullTokenizer(Tokenizer):
    """Text is whitespace-separated integer ids. As Megatron's: eod = vocab_size argument,
    so .vocab_size is one more than the argument."""

    def __init__(self, vocab_size: int):
        if int(vocab_size) < 1:
            raise ValueError(f"--vocab-size must be positive for NullTokenizer, got {vocab_size}")
        self.eod = self.pad = int(vocab_size)
        self.vocab_size = int(vocab_size) + 1

    def encode(self, text):
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            bad = next(x for x in text.split() if not x.lstrip("-").isdigit())
            raise ValueError(f"NullTokenizer: {bad[:40]!r} is not an integer id") from None
        if ids and (min(ids) < 0 or max(ids) >= self.vocab_size):
            raise ValueError(f"NullTokenizer: id out of range [0, {self.vocab_size}): {min(ids)}..{max(ids)}")
        return ids

    def decode(self, ids):
        return " ".join(str(int(i)) for i in ids)


HF_EOD_CANDIDATES = ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")
HF_PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<|finetune_right_pad_id|>")


class HuggingFaceTokenizer(Tokenizer):
    """A Hugging Face `tokenizer.json` (a file, or a directory holding one) via `tokenizers`.

    The end-of-document token is tokenizer_config.json's eos_token when that file sits beside
    tokenizer.json, else the first of the usual names present in the vocabulary; pad and bos
    are its pad_token and bos_token (Megatron's HuggingFaceTokenizer reads the same file)."""

    def __init__(self, path: str):
        HFTokenizer = require_package("tokenizers", "HuggingFaceTokenizer").Tokenizer

        file = os.path.join(path, "tokenizer.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise ValueError(f"--tokenizer-model {path}: no tokenizer.json found")
        try:
            self.tok = HFTokenizer.from_file(file)
        except Exception as e:  # the Rust side raises its own Exception type
            raise ValueError(f"--tokenizer-model {file}: not a Hugging Face tokenizer.json ({e})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        vocab = self.tok.get_vocab(with_added_tokens=True)
        eos = _config_token(os.path.join(os.path.dirname(file), "tokenizer_config.json"), "eos_token")
        candidates = ((eos,) if eos else ()) + HF_EOD_CANDIDATES
        eod = next((vocab[t] for t in candidates if t in vocab), None)
        if eod is None:
            raise ValueError(f"--tokenizer-model {file}: no end-of-document token found "
                             f"(tried {', '.join(candidates)})")
        self.eod = eod
        config_file = os.path.join(os.path.dirname(file), "tokenizer_config.json")
        pad, bos = _config_token(config_file, "pad_token"), _config_token(config_file, "bos_token")
        self.pad = vocab[pad] if pad in vocab else next((vocab[t] for t in HF_PAD_CANDIDATES if t in vocab), eod)
        self.bos = vocab.get(bos) if bos else None  # as transformers' bos_token_id: None without one

    def encode(self, text):
        return self.tok.encode(text, add_special_tokens=False).ids

    def encode_batch_bytes(self, texts):
        return [array("i", e.ids).tobytes() for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids):
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _config_token(config_file: str, key: str) -> str | None:
    if not os.path.isfile(config_file):
        return None
    try:
        with open(config_file, encoding="utf-8") as f:
            value = json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    if isinstance(value, dict):  # {"content": "</s>", ...}
        value = value.get("content")
    return value if isinstance(value, str) else None


# Megatron's TikTokenizer pre-tokenisation patterns (--tiktoken-pattern v1 / v2).
TIKTOKEN_PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+",
    "v2": r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
          r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
          r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+",
}
TIKTOKEN_SPECIALS = ("<unk>", "<s>", "</s>")


def load_tiktoken_ranks(path: str) -> dict[bytes, int]:
    """Token bytes -> rank from a tiktoken rank file ('base64 rank' lines) or Megatron's JSON
    list of {"rank", "token_bytes" (base64)}."""
    if not os.path.isfile(path):
        raise ValueError(f"--tokenizer-model {path}: file not found")
    ranks = {}
    try:
        if path.endswith(".json"):
            with open(path, encoding="utf-8") as f:
                for item in json.load(f):
                    ranks[base64.b64decode(item["token_bytes"])] = int(item["rank"])
        else:
            with open(path, "rb") as f:
                for lineno, line in enumerate(f, 1):
                    if line.strip():
                        token, rank = line.split()
                        ranks[base64.b64decode(token, validate=True)] = int(rank)
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        where = path if path.endswith(".json") else f"{path}:{lineno}"
        raise ValueError(f"--tokenizer-model {where}: not a tiktoken rank file "
                         f"(expected 'base64-token rank' lines or Megatron's JSON list): {e}") from None
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ValueError(f"--tokenizer-model {path}: ranks are not 0..{len(ranks) - 1} without gaps")
    return ranks


class TikTokenizer(Tokenizer):
    """Megatron's TikTokenizer layout: ids [0, num_special_tokens) are special tokens
    (<unk>, <s>, </s>, then fillers <SPECIAL_i>), rank r is id r + num_special_tokens;
    eod is </s>. --vocab-size, when given, caps the total (ranks beyond it are dropped)."""

    def __init__(self, path: str, vocab_size: int | None = None, tiktoken_pattern: str = "v2",
                 tiktoken_num_special_tokens: int = 1000, tiktoken_special_tokens=None):
        tiktoken = require_package("tiktoken", "TikTokenizer")
        if tiktoken_pattern not in TIKTOKEN_PATTERNS:
            raise ValueError(f"--tiktoken-pattern {tiktoken_pattern!r} is not one of v1, v2")
        specials = list(tiktoken_special_tokens or TIKTOKEN_SPECIALS)
        if not set(TIKTOKEN_SPECIALS) <= set(specials) or len(specials) > tiktoken_num_special_tokens:
            raise ValueError(f"--tiktoken-special-tokens must include {', '.join(TIKTOKEN_SPECIALS)} and "
                             f"number at most --tiktoken-num-special-tokens {tiktoken_num_special_tokens}")
        ranks = load_tiktoken_ranks(path)
        self.num_special = tiktoken_num_special_tokens
        if vocab_size is not None:
            inner = vocab_size - self.num_special
            if inner <= 0:
                raise ValueError(f"--vocab-size {vocab_size} leaves no room after "
                                 f"{self.num_special} special tokens")
            ranks = {t: r for t, r in ranks.items() if r < inner}
        self.special_tokens = specials + [f"<SPECIAL_{i}>" for i in range(len(specials), self.num_special)]
        self.enc = tiktoken.Encoding(name=os.path.basename(path), pat_str=TIKTOKEN_PATTERNS[tiktoken_pattern],
                                     mergeable_ranks=ranks, special_tokens={})
        self.vocab_size = vocab_size if vocab_size is not None else self.num_special + len(ranks)
        self.eod = self.special_tokens.index("</s>")
        self.pad = self.special_tokens.index("<unk>")

    def encode(self, text):
        return (np.asarray(self.enc.encode_ordinary(text), np.int64) + self.num_special).tolist()

    def encode_batch_bytes(self, texts):
        return [(np.asarray(ids, np.int32) + self.num_special).tobytes()
                for ids in self.enc.encode_ordinary_batch(texts, num_threads=1)]

    def decode(self, ids):
        out, inner = [], []
        for i in (int(i) for i in ids):
            if i < self.num_special:
                if inner:
                    out.append(self.enc.decode(inner))
                    inner = []
                out.append(self.special_tokens[i])
            else:
                inner.append(i - self.num_special)
        if inner:
            out.append(self.enc.decode(inner))
        return "".join(out)
