"""GPT-2 byte-level BPE (vocab.json + merges.txt), implemented here.

The algorithm is GPT-2's: split the text with GPT-2's pre-tokenisation regex, map each
piece's UTF-8 bytes to printable characters, then apply merges by rank until none applies.
Ids match Megatron's GPT2BPETokenizer and Hugging Face's byte-level BPE for the same files.

`encode_reference` is that algorithm as written (pure Python, one cache of pre-tokens).
`encode` gives the same ids faster. ASCII text goes through tiktoken's Rust BPE when
tiktoken is installed and the merges pass the checks of `_tiktoken_core`. Other text goes
through a `ChunkCache` (chunks end before a whitespace character that follows a
non-whitespace one, which the regex never matches across); unseen chunks are
pre-tokenised together, ASCII ones with an equivalent `re` pattern, and unseen pre-tokens
are merged by the `tokenizers` library's BPE when installed.
"""

import json
import os
import re
from array import array
from itertools import filterfalse

import numpy as np

from megalite.data.chunk_cache import ChunkCache
from megalite.data.tiktoken_bpe import TiktokenBPE, encode_split, tiktoken_module
from megalite.data.tokenizer_support import require_package

GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
# The same pattern for ASCII text, for the re module (2-3x faster than regex's \p classes):
# \p{L} and \p{N} restricted to ASCII are [A-Za-z] and [0-9], regex's \s on ASCII is re's
# ASCII \s, and the contractions share their apostrophe (same leftmost-first order).
GPT2_ASCII_PATTERN = r"""'(?:s|t|re|ve|m|ll|d)| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+"""
EOD_TOKEN = "<|endoftext|>"
# tiktoken runs the pattern without the lookahead \s+(?!\S) twice as fast. On ASCII text
# the lookahead matters only in a whitespace run of two or more before a non-space, where
# GPT-2 cuts before the run's last character: a NUL put there (RUN_END) makes the plain
# pattern cut there too, and since no merge involves the NUL byte its token is dropped.
GPT2_PLAIN_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+"""
RUN_END = re.compile(r"(?<=\s)(?=\s\S)", re.ASCII)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from the 256 byte values to printable unicode characters."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


def load_vocab(vocab_file: str) -> dict[str, int]:
    if not os.path.isfile(vocab_file):
        raise ValueError(f"--vocab-file {vocab_file}: file not found")
    try:
        with open(vocab_file, encoding="utf-8") as f:
            vocab = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"--vocab-file {vocab_file}: not a JSON vocabulary ({e})") from None
    if not isinstance(vocab, dict) or not all(isinstance(v, int) for v in vocab.values()):
        raise ValueError(f"--vocab-file {vocab_file}: expected a JSON object of token -> integer id")
    return vocab


def load_merges(merge_file: str) -> dict[tuple[str, str], int]:
    if not os.path.isfile(merge_file):
        raise ValueError(f"--merge-file {merge_file}: file not found")
    ranks = {}
    try:
        with open(merge_file, encoding="utf-8") as f:
            lines = f.read().split("\n")
    except UnicodeDecodeError as e:
        raise ValueError(f"--merge-file {merge_file}: not UTF-8 text ({e})") from None
    for lineno, line in enumerate(lines, 1):
        if not line or (lineno == 1 and line.startswith("#version")):
            continue
        parts = line.split(" ")
        if len(parts) != 2 or not all(parts):
            raise ValueError(f"--merge-file {merge_file}:{lineno}: expected two space-separated "
                             f"symbols, got {line[:60]!r}")
        ranks.setdefault((parts[0], parts[1]), len(ranks))
    return ranks


class GPT2BPE:
    """Byte-level BPE from GPT-2-style vocab.json and merges.txt."""

    def __init__(self, vocab_file: str, merge_file: str):
        regex = require_package("regex", "GPT2BPETokenizer")  # for \p{L}/\p{N}, which re lacks

        self.encoder = load_vocab(vocab_file)
        self.decoder = {v: k for k, v in self.encoder.items()}
        self.ranks = load_merges(merge_file)
        for (a, b) in self.ranks:
            if a + b not in self.encoder:
                raise ValueError(f"--merge-file {merge_file}: merge result {a + b!r} is not in "
                                 f"--vocab-file {vocab_file}")
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self._byte_table = [self.byte_encoder[b] for b in range(256)]
        self._pattern = regex.compile(GPT2_PATTERN)
        self._ascii_pattern = re.compile(GPT2_ASCII_PATTERN, re.ASCII)
        # The regex module's \s (Unicode White_Space; no code point above U+3000 has it).
        space = regex.compile(r"\s")
        self._whitespace = frozenset(chr(c) for c in range(0x3001) if space.match(chr(c)))
        self._reference_pieces: dict[str, bytes] = {}  # pre-token -> ids, for encode_reference
        self._fast_pieces: dict[str, bytes] = {}  # the same, for the chunk-cache path
        self._hf_bpe = _hf_bpe(self.encoder, self.ranks)
        # Chunks are cut with the re module (faster than regex here), using regex's \s set.
        ws_class = "".join(re.escape(c) for c in sorted(self._whitespace))
        chunk_pattern = re.compile(f"[{ws_class}]*[^{ws_class}]+|[{ws_class}]+")
        self._chunks = ChunkCache(chunk_pattern.findall, self._encode_chunks)
        self.vocab_file = vocab_file
        self._tiktoken = self._tiktoken_core()

    def bpe(self, word: str) -> list[str]:
        """Merge the symbols of one byte-mapped pre-token by rank until no merge applies."""
        parts = list(word)
        ranks = self.ranks
        while len(parts) > 1:
            best_rank, best = None, None
            for pair in zip(parts, parts[1:]):
                rank = ranks.get(pair)
                if rank is not None and (best_rank is None or rank < best_rank):
                    best_rank, best = rank, pair
            if best is None:
                break
            first, second = best
            merged, i, n = [], 0, len(parts)
            while i < n:
                if i < n - 1 and parts[i] == first and parts[i + 1] == second:
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(parts[i])
                    i += 1
            parts = merged
        return parts

    def _python_bpe_ids(self, mapped: str) -> list[int]:
        try:
            return [self.encoder[t] for t in self.bpe(mapped)]
        except KeyError as e:
            raise ValueError(f"--vocab-file {self.vocab_file}: no id for BPE symbol {e.args[0]!r}") from None

    def _fast_bpe_ids(self, mapped: str) -> list[int]:
        if self._hf_bpe is None:
            return self._python_bpe_ids(mapped)
        return [t.id for t in self._hf_bpe.tokenize(mapped)]

    def _piece_bytes(self, pieces, table: dict[str, bytes], bpe_ids) -> dict[str, bytes]:
        """`table` (pre-token -> int32 id bytes) with every piece of `pieces` present."""
        missing = set(filterfalse(table.__contains__, pieces))
        if len(table) + len(missing) > (1 << 19):
            table.clear()
            missing = set(pieces)
        byte_table = self._byte_table
        for piece in missing:
            table[piece] = array("i", bpe_ids("".join(byte_table[b] for b in piece.encode("utf-8")))).tobytes()
        return table

    def encode_reference(self, text: str) -> list[int]:
        """Plain GPT-2 encoding (regex, then BPE per pre-token with a per-pre-token cache, as
        Megatron's tokenizer does), without the chunk cache."""
        pieces = self._pattern.findall(text)
        table = self._piece_bytes(pieces, self._reference_pieces, self._python_bpe_ids)
        return array("i", b"".join(map(table.__getitem__, pieces))).tolist()

    def _encode_chunks(self, chunks: list[str]) -> list[bytes]:
        """Encode cache misses. Chunks that start with whitespace and end without it can be
        concatenated without changing their pre-tokens, so they share one regex pass (the
        regex module's per-call overhead dominates short chunks; ASCII ones use the faster
        re pattern) and one bytes.join, then are cut apart at pre-token boundaries; the
        rest go one by one."""
        ws = self._whitespace
        joinable = [c for c in chunks if c[0] in ws and c[-1] not in ws]
        out = {}
        for group, pattern in (([c for c in joinable if c.isascii()], self._ascii_pattern),
                               ([c for c in joinable if not c.isascii()], self._pattern)):
            if group:
                out.update(self._encode_joined(group, pattern))
        return [out[c] if c in out else array("i", self.encode_reference(c)).tobytes() for c in chunks]

    def _encode_joined(self, chunks: list[str], pattern) -> dict[str, bytes]:
        pieces = pattern.findall("".join(chunks))
        encoded = list(map(self._piece_bytes(pieces, self._fast_pieces, self._fast_bpe_ids).__getitem__, pieces))
        joined = b"".join(encoded)
        piece_ends = np.cumsum(list(map(len, pieces)))
        byte_ends = np.cumsum(list(map(len, encoded)))
        last_piece = np.searchsorted(piece_ends, np.cumsum(list(map(len, chunks))))  # chunks end at piece ends
        stops = byte_ends[last_piece].tolist()
        return {c: joined[a:b] for c, a, b in zip(chunks, [0] + stops[:-1], stops)}

    def _tiktoken_core(self) -> TiktokenBPE | None:
        """tiktoken over these merges, or None where it would not give GPT-2's ids.

        Checked: every merge joins two symbols that exist before it (single bytes or
        results of earlier merges), no two merges make the same token, no merge involves
        the NUL byte, and every merged token encodes to itself. Then no two adjacent
        symbols ever concatenate to a token other than through their own merge (the
        shortest such pair would be a state of encoding its own concatenation, which would
        then not encode to itself), so merging the lowest-ranked concatenation first, as
        tiktoken does, is GPT-2's merging by rank, and a pre-token that is a token is that
        token.
        """
        if tiktoken_module() is None:
            return None
        byte_chars = [self.byte_encoder[b] for b in range(256)]
        if any(c not in self.encoder for c in byte_chars):
            return None
        ranks = {bytes([b]): b for b in range(256)}
        rank_ids = [self.encoder[c] for c in byte_chars]
        formed = set(byte_chars)
        nul = self.byte_encoder[0]
        merged = []
        for a, b in sorted(self.ranks, key=self.ranks.get):
            if a not in formed or b not in formed or a + b in formed or nul in a or nul in b:
                return None
            formed.add(a + b)
            merged.append(a + b)
            ranks[bytes(self.byte_decoder[c] for c in a + b)] = len(rank_ids)
            rank_ids.append(self.encoder[a + b])
        if any(len(self._fast_bpe_ids(t)) != 1 for t in merged):
            return None
        return TiktokenBPE("gpt2", ranks, np.array(rank_ids), {"plain": GPT2_PLAIN_PATTERN}, drop_rank=0)

    def _encode_tiktoken(self, texts: list[str]) -> list[bytes]:
        return self._tiktoken.encode_bytes([RUN_END.sub("\x00", t) for t in texts], "plain")

    def encode(self, text: str) -> list[int]:
        return np.frombuffer(self.encode_batch_bytes([text])[0], np.int32).tolist()

    def encode_batch_bytes(self, texts: list[str]) -> list[bytes]:
        if self._tiktoken is None:
            return self._chunks.encode_batch_bytes(texts)
        return encode_split(texts, _ascii_without_nul, self._encode_tiktoken, self._chunks.encode_batch_bytes)

    def decode(self, ids) -> str:
        text = "".join(self.decoder[int(i)] for i in ids)
        return bytes(self.byte_decoder[c] for c in text).decode("utf-8", errors="replace")


def _ascii_without_nul(text: str) -> bool:
    return text.isascii() and "\x00" not in text


def _hf_bpe(encoder: dict[str, int], ranks: dict[tuple[str, str], int]):
    """The same merges run by the `tokenizers` library's BPE model (Rust), when installed;
    tests check it gives the Python algorithm's ids."""
    try:
        from tokenizers import models
    except ImportError:
        return None
    return models.BPE(vocab=encoder, merges=sorted(ranks, key=ranks.get))
