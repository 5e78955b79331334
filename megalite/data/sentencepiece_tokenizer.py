"""SentencePiece (.model) tokenizer, with an exact word-cache fast path for BPE models.

SentencePiece BPE never merges across a space that follows a non-space (its pieces cannot
contain one), so text cut before such spaces tokenises word by word. When the model's
settings make that cut exact (checked from the model proto, see `word_cache_applies`),
repeated words come from a `ChunkCache` and only unseen words reach SentencePiece, joined
into one call. Otherwise every text goes to SentencePiece directly.
"""

import os
import re

import numpy as np

from megalite.data.chunk_cache import ChunkCache

SPACE = "\u2581"  # SentencePiece's visible space
WORD = re.compile(f"[ {SPACE}]+[^ {SPACE}]*")  # applied to " " + text: the dummy prefix
PIECE_NORMAL, PIECE_USER_DEFINED, PIECE_BYTE = 1, 4, 6
JOIN_CHARS = 4096  # unseen words are encoded in texts of about this size
MODEL_BPE = 2


def word_cache_applies(model_bytes: bytes) -> bool:
    """True when encoding word by word equals encoding whole texts for this model."""
    try:
        from sentencepiece import sentencepiece_model_pb2
    except ImportError:  # protobuf missing: no way to check, so no fast path
        return False
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_bytes)
    trainer, norm = proto.trainer_spec, proto.normalizer_spec
    if not (trainer.model_type == MODEL_BPE and trainer.byte_fallback
            and not trainer.treat_whitespace_as_suffix
            and norm.name == "identity" and not norm.precompiled_charsmap
            and norm.add_dummy_prefix and norm.escape_whitespaces
            and not norm.remove_extra_whitespaces):
        return False
    crosses_word = re.compile(f"[^{SPACE}]{SPACE}")
    for piece in proto.pieces:
        if piece.type == PIECE_USER_DEFINED:
            return False
        if piece.type == PIECE_NORMAL and crosses_word.search(piece.piece):
            return False
    return True


class SentencePieceTokenizer:
    """Megatron's SentencePieceTokenizer for GPT: eod is the model's </s> (eos) id."""

    def __init__(self, model_file: str, use_word_cache: bool = True):
        import sentencepiece as spm

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
        self._cache = None
        if use_word_cache and word_cache_applies(model_bytes):
            self._surface = self._surface_bytes()
            self._cache = ChunkCache(lambda text: WORD.findall(" " + text) if text else [],
                                     self._encode_words)

    def _surface_bytes(self) -> np.ndarray:
        """UTF-8 length, in the normalised text, that each id covers."""
        sp = self.sp
        out = np.zeros(self.vocab_size, np.int64)
        for i in range(self.vocab_size):
            if sp.is_byte(i):
                out[i] = 1
            elif not (sp.is_control(i) or sp.is_unknown(i)):
                out[i] = len(sp.id_to_piece(i).encode("utf-8"))
        return out

    def _encode_words(self, words: list[str]) -> list[bytes]:
        """Encode unseen words (each starts with a space). Words ending in a non-space are
        joined into texts of a few KB (SentencePiece slows down on long inputs), encoded in
        one batch call, and cut apart by the bytes each id covers."""
        joinable = [w for w in words if w[-1] not in (" ", SPACE)]
        out = {}
        if joinable:
            texts, group, size = [], [], 0
            for w in joinable:
                group.append(w)
                size += len(w)
                if size >= JOIN_CHARS:
                    texts.append("".join(group)[1:])
                    group, size = [], 0
            if group:
                texts.append("".join(group)[1:])
            ids = np.concatenate(self.sp.encode(texts, out_type="numpy", num_threads=1))
            ends = np.cumsum(self._surface[ids])
            # normalised length: a space becomes U+2581, three bytes instead of one
            word_ends = np.cumsum([len(w.encode("utf-8")) + 2 * w.count(" ") for w in joinable])
            if len(ends) and ends[-1] == word_ends[-1]:
                cuts = (np.searchsorted(ends, word_ends, side="left") + 1).tolist()
                raw = ids.astype(np.int32).tobytes()
                out = {w: raw[4 * s:4 * e] for w, s, e in zip(joinable, [0] + cuts[:-1], cuts)}
        return [out[w] if w in out else self._encode_word_alone(w) for w in words]

    def _encode_word_alone(self, word: str) -> bytes:
        # After the word "a" (dummy prefix included), `word` is a word of its own; encoding
        # word[1:] instead fails for a lone trailing space, which would become empty.
        ids = self.sp.encode("a" + word, out_type="numpy")
        return ids[len(self.sp.encode("a")):].astype(np.int32).tobytes()

    def encode_reference(self, text: str) -> list[int]:
        """SentencePiece's own encoding of the whole text."""
        return self.sp.encode(text)

    def encode(self, text: str) -> list[int]:
        return self._cache.encode(text) if self._cache else self.sp.encode(text)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        if self._cache:
            return self._cache.encode_batch(texts)
        return [np.asarray(x, np.int32) for x in self.sp.encode(texts, out_type="numpy", num_threads=1)]

    def encode_batch_bytes(self, texts: list[str]) -> list[bytes]:
        if self._cache:
            return self._cache.encode_batch_bytes(texts)
        return [x.astype(np.int32).tobytes() for x in self.sp.encode(texts, out_type="numpy", num_threads=1)]

    def decode(self, ids) -> str:
        return self.sp.decode([int(i) for i in ids])
