"""SentencePiece (.model) tokenizer, with an exact chunk-cache fast path for BPE models.

SentencePiece BPE merges two adjacent symbols only when their concatenation is a piece of
the vocabulary. So if no piece contains a given pair of adjacent characters, text cut
between such a pair tokenises piece by piece exactly as it does whole. The model is checked
once (its proto, see `chunking_for`):
- "fine": no piece joins a letter, a digit and another character of different kinds, nor
  anything followed by a space (SentencePiece's defaults split_by_unicode_script,
  split_digits and split_by_whitespace give such vocabularies). Chunks are optional leading
  spaces plus one run of letters, of digits or of other characters.
- "word": no piece has a space after a non-space. Chunks are leading spaces plus a word.
- None: every text goes to SentencePiece whole.
With tiktoken installed, a chunkable model whose pieces pass the checks of
`_tiktoken_core` is run by tiktoken's Rust BPE (pre-tokens: the chunks). Otherwise repeated
chunks come from a `ChunkCache`; unseen ones are encoded together, a few KB of text per
call, with a separator character between two that would otherwise touch unsafely, and cut
apart again by the length of text each id covers.
"""

import os
import re

import numpy as np

from megalite.data.chunk_cache import ChunkCache
from megalite.data.tiktoken_bpe import TiktokenBPE, encode_split, tiktoken_module
from megalite.data.tokenizer_support import require_package

SPACE = "\u2581"  # SentencePiece's visible space
CHUNK_PATTERNS = {  # applied to " " + text (the space stands for the dummy prefix)
    "word": re.compile(f"[ {SPACE}]+[^ {SPACE}]*"),
    "fine": re.compile(f"[ {SPACE}]*(?:[^\\W\\d_]+|\\d+|(?:[^\\w {SPACE}]|_)+)|[ {SPACE}]+"),
}
# The "fine" classes restricted to ASCII (letters, digits, the rest), for ASCII text: faster.
FINE_ASCII_PATTERN = re.compile(r" *(?:[A-Za-z]+|[0-9]+|[^A-Za-z0-9 ]+)| +")
# tiktoken's pre-tokens: the same chunks, with the space standing for U+2581 in pieces too.
TIKTOKEN_PATTERNS = {"fine": FINE_ASCII_PATTERN.pattern, "word": r" *[^ ]+| +"}
SEPARATORS = {"L": "a", "D": "0", "O": "."}  # one character of each kind
PIECE_NORMAL, PIECE_USER_DEFINED, PIECE_UNUSED, PIECE_BYTE = 1, 4, 5, 6
JOIN_CHARS = 4096  # unseen chunks are encoded in texts of about this size (SentencePiece
# slows down on long inputs)
MODEL_BPE = 2


def char_kind(c: str) -> str:
    """S(pace), D(igit), L(etter) or O(ther), exactly as the CHUNK_PATTERNS classes."""
    if c == " " or c == SPACE:
        return "S"
    if c.isdecimal():
        return "D"
    if c.isalnum() and c != "_":
        return "L"
    return "O"


def parse_model(model_bytes: bytes):
    """The model's ModelProto, or None without protobuf (then no fast path can be checked)."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:
        return None
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_bytes)
    return proto


def chunking_for(proto) -> str | None:
    """'fine', 'word' or None: the finest chunking that is exact for this model."""
    if proto is None:
        return None
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if not (trainer.model_type == MODEL_BPE and trainer.byte_fallback
            and not trainer.treat_whitespace_as_suffix
            and norm.name == "identity" and not norm.precompiled_charsmap
            and norm.add_dummy_prefix and norm.escape_whitespaces
            and not norm.remove_extra_whitespaces):
        return None
    pairs = set()
    for piece in proto.pieces:
        if piece.type == PIECE_USER_DEFINED:
            return None
        if piece.type == PIECE_NORMAL:
            kinds = [char_kind(c) for c in piece.piece]
            pairs.update(zip(kinds, kinds[1:]))
    if any(b == "S" and a != "S" for a, b in pairs):
        return None
    return "fine" if all(a == b or a == "S" for a, b in pairs) else "word"


class SentencePieceTokenizer:
    """Megatron's SentencePieceTokenizer for GPT: eod is the model's </s> (eos) id."""

    def __init__(self, model_file: str, use_chunk_cache: bool = True):
        spm = require_package("sentencepiece", "SentencePieceTokenizer")

        if not model_file or not os.path.isfile(model_file):
            raise ValueError(f"--tokenizer-model {model_file}: file not found")
        with open(model_file, "rb") as f:
            model_bytes = f.read()
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        except (RuntimeError, OSError) as e:
            raise ValueError(f"--tokenizer-model {model_file}: not a SentencePiece model ({e})") from None
        self.model_file = model_file
        self.vocab_size = self.sp.get_piece_size()
        if self.sp.eos_id() < 0:
            raise ValueError(f"--tokenizer-model {model_file}: the model has no </s> (eos) piece "
                             "to use as end-of-document token")
        self.eod = self.sp.eos_id()
        self.pad = self.sp.pad_id() if self.sp.pad_id() >= 0 else self.eod
        self.bos = self.sp.bos_id()
        proto = parse_model(model_bytes) if use_chunk_cache else None
        self.chunking = chunking_for(proto)
        self._cache = self._tiktoken = None
        if self.chunking:
            self._surface, self._surface_chars = self._surface_lengths()
            split = CHUNK_PATTERNS[self.chunking].findall
            split_ascii = FINE_ASCII_PATTERN.findall if self.chunking == "fine" else split  # faster, same chunks
            self._cache = ChunkCache(lambda t: (split_ascii if t.isascii() else split)(" " + t) if t else [],
                                     self._encode_chunks)
            self._tiktoken = self._tiktoken_core(proto)

    def _surface_lengths(self) -> tuple[np.ndarray, np.ndarray]:
        """(UTF-8 bytes, characters) of normalised text that each id covers; a byte piece
        covers one byte and an unknown number of characters (-1)."""
        sp = self.sp
        nbytes = np.zeros(self.vocab_size, np.int64)
        nchars = np.zeros(self.vocab_size, np.int64)
        for i in range(self.vocab_size):
            if sp.is_byte(i):
                nbytes[i], nchars[i] = 1, -1
            elif not (sp.is_control(i) or sp.is_unknown(i)):
                piece = sp.id_to_piece(i)
                nbytes[i], nchars[i] = len(piece.encode("utf-8")), len(piece)
        return nbytes, nchars

    def _encode_chunks(self, chunks: list[str]) -> list[bytes]:
        """Encode unseen chunks, several KB of text per SentencePiece call.

        Each text is a sequence of segments: chunks, and separators that are encoded but
        thrown away. SentencePiece puts its dummy-prefix space before each text: a first
        chunk starting with a space lends it that space; otherwise a separator follows
        it. Between two chunks whose touching characters are of the same kind (a pair a
        piece may join) goes a separator of a third kind. A chunk of spaces only (the end
        of a document) must end its text, or it would join the next chunk's spaces.
        """
        texts, segments, parts, size = [], [], [], 0
        prev = None  # kind of the last character of the text being built
        for c in chunks:
            first, last = char_kind(c[0]), char_kind(c[-1])
            lend = prev is None and first == "S" and last != "S"
            if prev is None and not lend:
                parts.append(SEPARATORS["L" if first != "L" else "D"])
                segments.append((None, 2))  # dummy space + separator
            elif prev is not None and first != "S" and first == prev:
                parts.append(SEPARATORS[next(k for k in "LDO" if k != first)])
                segments.append((None, 1))
            parts.append(c[1:] if lend else c)
            segments.append((c, len(c)))
            size += len(c)
            prev = last
            if prev == "S" or size >= JOIN_CHARS:
                texts.append("".join(parts))
                parts, size, prev = [], 0, None
        if parts:
            texts.append("".join(parts))
        ids = np.concatenate(self.sp.encode(texts, out_type="numpy", num_threads=1))
        chars = self._surface_chars[ids]
        if chars.min(initial=0) >= 0:  # no byte pieces: count characters
            ends = np.cumsum(chars)
            seg_ends = np.cumsum([n for _, n in segments])
        else:  # count UTF-8 bytes of the normalised text (a space becomes 3-byte U+2581)
            ends = np.cumsum(self._surface[ids])
            seg_ends = np.cumsum([_normalised_bytes(c) if c is not None else n + 2 * (n == 2)
                                  for c, n in segments])
        cuts = np.searchsorted(ends, seg_ends, side="left") + 1
        if not len(ends) or cuts[-1] != len(ends) or not np.array_equal(ends[cuts - 1], seg_ends):
            raise AssertionError("SentencePiece ids do not line up with the chunks they encode")
        cuts = cuts.tolist()
        raw = ids.astype(np.int32).tobytes()
        out = {c: raw[4 * a:4 * b] for (c, _), a, b in zip(segments, [0] + cuts[:-1], cuts) if c is not None}
        return [out[c] for c in chunks]

    def _tiktoken_core(self, proto) -> TiktokenBPE | None:
        """tiktoken over this model's pieces, or None where it would not give its ids.

        SentencePiece's BPE merges the adjacent pair whose concatenation is the
        best-scoring piece; tiktoken merges the lowest-ranked concatenation: pieces ranked
        by score give the same merges once every character is one symbol, so characters of
        several UTF-8 bytes are assembled first (their byte prefixes rank below every
        piece). Checked: no unused pieces, distinct scores, every character of a piece is a
        piece itself, and every piece encodes to itself (tiktoken returns a pre-token that
        is a piece as is). Pieces are keyed with a space for U+2581, as texts are given.
        """
        if tiktoken_module() is None or any(p.type == PIECE_UNUSED for p in proto.pieces):
            return None
        chars, merged, byte_ids = {}, [], {}
        for i, p in enumerate(proto.pieces):
            if p.type == PIECE_BYTE:
                byte_ids[int(p.piece[3:5], 16)] = i
            elif p.type == PIECE_NORMAL:
                piece = p.piece.replace(SPACE, " ")
                if len(piece) == 1:
                    chars[piece] = i
                else:
                    merged.append((-p.score, i, piece))
        if len(byte_ids) != 256 or " " not in chars or len({s for s, _, _ in merged}) != len(merged):
            return None
        if any(c not in chars for _, _, piece in merged for c in piece):
            return None
        ranks = {bytes([b]): b for b in range(256)}
        rank_ids = [chars.get(chr(b), byte_ids[b]) if b < 128 else byte_ids[b] for b in range(256)]
        for c, i in chars.items():
            encoded = c.encode("utf-8")
            for k in range(2, len(encoded) + 1):
                if encoded[:k] not in ranks:
                    ranks[encoded[:k]] = len(rank_ids)
                    rank_ids.append(i if k == len(encoded) else -1)  # a byte prefix: not a piece
        merged.sort()
        for _, i, piece in merged:
            ranks[piece.encode("utf-8")] = len(rank_ids)
            rank_ids.append(i)
        plain = type(proto)()
        plain.CopyFrom(proto)
        plain.normalizer_spec.add_dummy_prefix = False
        plain_sp = type(self.sp)(model_proto=plain.SerializeToString())
        texts = [p.replace(" ", SPACE) for _, _, p in merged]
        if plain_sp.encode(texts) != [[i] for _, i, _ in merged]:
            return None
        return TiktokenBPE("sentencepiece", ranks, np.array(rank_ids), TIKTOKEN_PATTERNS)

    def _encode_tiktoken(self, texts: list[str], pattern: str) -> list[bytes | None]:
        """SentencePiece's normalisation here: the dummy-prefix space, U+2581 as a space."""
        return self._tiktoken.encode_bytes([" " + t.replace(SPACE, " ") if t else "" for t in texts], pattern)

    def _encode_words(self, texts: list[str]) -> list[bytes]:
        return encode_split(texts, bool, lambda ts: self._encode_tiktoken(ts, "word"), self._encode_plain)

    def _encode_plain(self, texts: list[str]) -> list[bytes]:
        return [x.astype(np.int32).tobytes() for x in self.sp.encode(texts, out_type="numpy", num_threads=1)]

    def encode_reference(self, text: str) -> list[int]:
        """SentencePiece's own encoding of the whole text."""
        return self.sp.encode(text)

    def encode(self, text: str) -> list[int]:
        return np.frombuffer(self.encode_batch_bytes([text])[0], np.int32).tolist()

    def encode_batch_bytes(self, texts: list[str]) -> list[bytes]:
        if self._tiktoken is not None:
            if self.chunking == "fine":
                return encode_split(texts, str.isascii, lambda ts: self._encode_tiktoken(ts, "fine"),
                                    self._encode_words)
            return self._encode_words(texts)
        if self._cache:
            return self._cache.encode_batch_bytes(texts)
        return self._encode_plain(texts)

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])


def _normalised_bytes(chunk: str) -> int:
    """UTF-8 length after normalisation: each space becomes U+2581 (3 bytes)."""
    return len(chunk.encode("utf-8")) + 2 * chunk.count(" ")
